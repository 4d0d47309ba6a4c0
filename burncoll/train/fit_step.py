"""One step of :func:`burncoll.train.fit.fit` on one replica: averaging the loss and the
gradients (:class:`StepReducer`), applying an optimizer's updates, and the progress bar.

``grad_fn`` returns its gradients as a tree (one bucketed
:func:`~burncoll.comm.buckets.all_reduce_tree` after it returns) or as an iterator of ``(key,
grad)`` pairs, last layer first, fed to a :class:`~burncoll.train.overlap.GradientBuckets` so
buckets reduce while backward runs. As DDP does, the first step's buckets follow the reverse
flattening order; then the order rank 0's generator yielded is broadcast and used by every peer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend, Device
from burncoll.comm.buckets import all_reduce_tree, flatten_tree
from burncoll.comm.communicator import Communicator
from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.train.checkpoint import from_numpy
from burncoll.train.overlap import GradientBuckets

__all__ = ["Progress", "StepReducer", "apply_updates", "loss_leaf"]


class StepReducer:
    """Averages each step's loss and gradients over every peer, for one replica of ``fit``
    (see the module: a tree at once, an iterator of ``(key, grad)`` bucket by bucket)."""

    def __init__(self, comm: Communicator, bucket_bytes: int) -> None:
        self._comm = comm
        self._backend = get_backend(comm.config.backend)
        self._bucket_bytes = bucket_bytes
        #: The agreed bucket order (leaf indices of ``(loss, params)``) after the first
        #: streamed step; ``None`` before it.
        self.order: list[int] | None = None

    def __call__(self, params: Any, loss: Any, grads: Any) -> tuple[Array, Any]:
        """``(mean loss, mean gradients)`` over every peer; the gradients shaped as
        ``params`` when ``grads`` is an iterator, as ``grads`` otherwise."""
        comm, backend = self._comm, self._backend
        if not isinstance(grads, Iterator):
            leaf = loss_leaf(backend, loss, grads, comm.device)
            return all_reduce_tree(comm, (leaf, grads), "mean", self._bucket_bytes)
        leaf = loss_leaf(backend, loss, params, comm.device)
        buckets = GradientBuckets(comm, (leaf, params), "mean", self._bucket_bytes,
                                  order=self.order, keys_under=(1,))
        buckets.ready_leaf(0, leaf)
        for item in grads:
            if not isinstance(item, tuple) or len(item) != 2:
                raise UsageError("a grad_fn returning an iterator must yield (key, grad) pairs, "
                                 f"got {type(item).__name__}")
            buckets.ready(*item)
        loss_mean, reduced = buckets.wait()
        if self.order is None:
            self.order = self._rank0_order(buckets.arrival_order)
        return loss_mean, reduced

    def _rank0_order(self, mine: list[int]) -> list[int]:
        """Rank 0's ``mine``, on every peer (one broadcast)."""
        comm, backend = self._comm, self._backend
        root = comm.peer_ids[0]
        host = np.asarray(mine, dtype=np.int32)
        got = comm.broadcast(from_numpy(backend, host, comm.device) if comm.peer_id == root
                             else None, root)
        return [int(i) for i in np.asarray(backend.to_host(got))]


def loss_leaf(backend: Backend, loss: Any, grads: Any, device: Device) -> Array:
    """The loss as a 0-d array of ``backend``, in the first float dtype of ``grads`` (a tree)
    when it is not an array."""
    if backend.is_array(loss):
        if backend.shape(loss) != ():
            raise UsageError(f"grad_fn must return a scalar loss, got shape {backend.shape(loss)}")
        return loss
    like = "float64"
    for leaf in flatten_tree(grads)[0]:
        if backend.is_array(leaf) and is_inexact(dtype_from_name(backend.dtype_name(leaf))):
            like = backend.dtype_name(leaf)
            break
    host = np.asarray(loss, dtype=dtype_from_name(like))
    if host.shape != ():
        raise UsageError(f"grad_fn must return a scalar loss, got shape {host.shape}")
    return from_numpy(backend, host, device)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, in the params' dtypes, as ``optax.apply_updates``. Written
    out rather than calling optax, which would turn NumPy leaves into JAX arrays."""
    p_leaves, unflatten = flatten_tree(params)
    u_leaves, _ = flatten_tree(updates)
    if len(p_leaves) != len(u_leaves):
        raise UsageError(
            f"the optimizer returned {len(u_leaves)} updates for {len(p_leaves)} parameters"
        )
    return unflatten([(p + u).astype(p.dtype) for p, u in zip(p_leaves, u_leaves, strict=True)])


class Progress:
    """A tqdm bar with the loss; plain lines on stderr when tqdm is not installed or stderr
    is no terminal (a log file, or ``burncoll launch``, which prefixes each node's lines: a
    bar's redraws would each become a line there)."""

    def __init__(self, total: int, desc: str, enabled: bool, done: int = 0) -> None:
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._done = done
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, initial=min(done, total), desc=desc, unit="step",
                             dynamic_ncols=True)

    def step(self, loss: float) -> None:
        if not self._enabled:
            return
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            self._bar.update(1)
        elif self._done % max(1, self._total // 10) == 0 or self._done == self._total:
            print(f"{self._desc}: step {self._done}/{self._total} loss {loss:.4g}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
