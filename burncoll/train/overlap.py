"""Gradient buckets reduced while backward still runs: DDP's overlap, for any grad function.

As ``torch.nn.parallel.DistributedDataParallel`` does, gradients are packed into buckets in the
reverse order of the parameters, and a bucket's all-reduce (``async_op=True``) starts once all
its gradients are ready, while backward computes the next ones::

    buckets = GradientBuckets(comm, params, "mean", bucket_bytes=4 * 2**20)
    for key, grad in backward(params, batch):   # e.g. "w3", "b3", "w2", ... last layer first
        buckets.ready(key, grad)                 # full buckets start reducing now
    grads = buckets.wait()                       # a tree shaped like params

Every peer issues bucket ``k`` once it and every bucket before it are complete, so gradients
may arrive in any order. The bucket plan is a pure function of ``like`` and ``order``, which
every peer must pass alike; ``fit`` rebuilds it in the order rank 0's ``grad_fn`` yielded
(:class:`burncoll.train.fit.StepReducer`).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from burncoll.backends import get_backend
from burncoll.backends.base import Array
from burncoll.comm.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    all_reduce_flat,
    flatten_tree,
    leaf_spec,
    leaf_specs,
    pack,
    plan_stream_buckets,
    unpack_bucket,
)
from burncoll.comm.communicator import Communicator
from burncoll.errors import UsageError
from burncoll.ops import ReduceOp, parse_reduce_op
from burncoll.work import Work

__all__ = ["GradientBuckets", "leaf_paths", "plan_stream_buckets"]

T = TypeVar("T")

#: A leaf's path in a tree: the dict keys and sequence indices from the root to it.
Path = tuple[Any, ...]


def leaf_paths(tree: Any) -> list[Path]:
    """The path of every leaf of ``tree``, in :func:`~burncoll.comm.buckets.flatten_tree`'s order.

    ``{"w": a, "layers": [{"b": c}]}`` gives ``[("layers", 0, "b"), ("w",)]``. With jax
    imported, the paths are ``jax.tree_util``'s (a named tuple's field by name, a registered
    pytree's keys as it names them).
    """
    if "jax" in sys.modules:
        import jax

        keyed, _ = jax.tree_util.tree_flatten_with_path(tree)
        return [tuple(_jax_key(k) for k in path) for path, _ in keyed]
    paths: list[Path] = []
    _walk(tree, (), paths)
    return paths


def _jax_key(key: Any) -> Any:
    for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return key  # pragma: no cover - a key type of a newer jax


def _walk(node: Any, path: Path, paths: list[Path]) -> None:
    if node is None:
        return
    if isinstance(node, Mapping):
        keys = list(node) if isinstance(node, OrderedDict) else sorted(node)
        for k in keys:
            _walk(node[k], (*path, k), paths)
    elif isinstance(node, list | tuple):
        for i, child in enumerate(node):
            _walk(child, (*path, i), paths)
    else:
        paths.append(path)


class GradientBuckets(Generic[T]):
    """One step's gradients, all-reduced bucket by bucket as they are handed in.

    - ``like``: a tree shaped like the gradients (the parameters): its structure, leaf
      dtypes and shapes fix the buckets; its values are not used.
    - ``op``: the reduction, by default the mean over every peer (gradients).
    - ``bucket_bytes``: DDP's ``bucket_cap_mb``, in bytes. Smaller buckets start reducing
      sooner; each costs one collective.
    - ``order``: leaf indices (in :func:`~burncoll.comm.buckets.flatten_tree`'s order) in the
      order their gradients will be ready; by default the reverse of that order, DDP's
      assumption that backward yields the last parameters first.
    - ``keys_under``: the path of the subtree of ``like`` whose paths :meth:`ready` takes
      (``fit`` passes ``(1,)`` for ``like=(loss, params)``).

    One object per step; every peer must build it with the same ``like`` structure, dtypes,
    shapes, ``bucket_bytes`` and ``order``, and hand in every gradient. A gradient handed in
    is read by the communicator's worker thread until :meth:`wait` returns: do not modify it
    before (the usual rule of ``async_op=True``); the results are new arrays.
    """

    def __init__(self, comm: Communicator, like: T, op: ReduceOp | str = "mean",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, order: Sequence[int] | None = None,
                 keys_under: Path = ()) -> None:
        self._comm = comm
        self._op = parse_reduce_op(op)
        self._backend = get_backend(comm.config.backend)
        leaves, self._unflatten = flatten_tree(like)
        self._specs = leaf_specs(self._backend, leaves, self._op, "GradientBuckets")
        self._paths = {path: i for i, path in enumerate(leaf_paths(like))}
        self._under = tuple(keys_under)
        n = len(self._specs)
        self.buckets = plan_stream_buckets(
            self._specs, range(n - 1, -1, -1) if order is None else order, bucket_bytes)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.leaves}
        self._missing = [len(bucket.leaves) for bucket in self.buckets]
        self._grads: list[Any] = [None] * n
        self._works: list[Work[Array] | None] = []
        #: The leaf indices in the order :meth:`ready` received them.
        self.arrival_order: list[int] = []
        self._result: list[T] = []  # the tree, once wait() has built it

    @property
    def issued(self) -> int:
        """How many buckets' all-reduces have been issued so far (they are in flight or done)."""
        return len(self._works)

    def ready(self, key: Any, grad: Array) -> None:
        """Hand in the gradient of the leaf at path ``key`` (DDP's per-parameter hook).

        ``key`` is the leaf's path under ``keys_under`` (:func:`leaf_paths`), or for a leaf
        one level down (a dict of arrays) its key alone: ``"w1"`` for ``("w1",)``. Once a
        bucket and every bucket before it are complete, its all-reduce is issued.
        """
        # a tuple is a path, or a dict key that is a tuple
        paths = [(*self._under, *key)] if isinstance(key, tuple) else []
        for path in [*paths, (*self._under, key)]:
            if path in self._paths:
                self.ready_leaf(self._paths[path], grad)
                return
        known = [p[len(self._under):] for p in self._paths if p[:len(self._under)] == self._under]
        raise UsageError(f"GradientBuckets.ready: no leaf at {key!r}; the leaves are at "
                         f"{known[:8]}{' ...' if len(known) > 8 else ''}")

    def ready_leaf(self, index: int, grad: Array) -> None:
        """Hand in the gradient of leaf ``index`` (in flattening order); see :meth:`ready`."""
        if not 0 <= index < len(self._specs) or isinstance(index, bool):
            raise UsageError(f"leaf index {index!r} is not in 0..{len(self._specs) - 1}")
        if self._grads[index] is not None:
            raise UsageError(f"the gradient of leaf {index} was handed in twice in one step")
        spec, got = self._specs[index], leaf_spec(self._backend, grad, index)
        if got != spec:
            raise UsageError(f"the gradient of leaf {index} is {got.dtype}{list(got.shape)}; "
                             f"its parameter is {spec.dtype}{list(spec.shape)}")
        self._grads[index] = grad
        self.arrival_order.append(index)
        self._missing[self._bucket_of[index]] -= 1
        while len(self._works) < len(self.buckets) and self._missing[len(self._works)] == 0:
            self._works.append(self._issue(self.buckets[len(self._works)]))

    def _issue(self, bucket: Bucket) -> Work[Array] | None:
        if bucket.size == 0:  # nothing to exchange; every peer skips it alike
            return None
        work: Work[Array] = all_reduce_flat(self._comm, self._op,
                                            *pack(self._backend, bucket, self._grads),
                                            async_op=True)
        return work

    def wait(self, timeout: float | None = None) -> T:
        """The reduced tree, shaped like ``like``, once every bucket is reduced; bitwise
        identical on every peer. The first failing bucket's error is raised here.
        ``timeout``: as :meth:`burncoll.Work.wait`, for all the buckets together."""
        if self._result:
            return self._result[0]
        missing = [i for i, g in enumerate(self._grads) if g is None]
        if missing:
            paths = {i: p for p, i in self._paths.items()}
            raise UsageError(f"GradientBuckets.wait: the gradients of {len(missing)} leaves "
                             f"were never handed in: {[paths[i] for i in missing[:8]]}")
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Any] = [None] * len(self._specs)
        for bucket, work in zip(self.buckets, self._works, strict=True):
            if work is None:
                for i in bucket.leaves:
                    out[i] = self._backend.to_device(self._backend.copy(self._grads[i]),
                                                     self._comm.device)
                continue
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            unpack_bucket(self._backend, bucket, self._specs, work.wait(left), out)
        result: T = self._unflatten(out)
        self._result.append(result)
        return result
