"""Collectives over nested structures ("trees") of arrays, packed into a few buckets.

A model's parameters and gradients are trees: dicts, lists, tuples (named tuples included)
and, once jax is imported, any JAX pytree, with arrays at the leaves. Reducing every leaf with
its own collective costs one rendezvous per leaf; here the leaves are grouped by dtype,
flattened and concatenated into buckets of at most ``bucket_bytes`` bytes, each bucket takes
one collective, and the results are cut back into the original shapes. A model with hundreds
of small parameters therefore costs a handful of collectives.

Determinism. Leaves are visited in a fixed order: dict keys sorted (an ``OrderedDict`` keeps
its order), lists and tuples in order, ``None`` holds no leaf. That is the order
``jax.tree_util`` uses for these containers, so a node that has jax imported and one that has
not agree. The bucket layout depends only on that order and on the leaves' dtypes and shapes,
so every peer that passes a tree of the same structure, dtypes and shapes issues the same
collectives in the same order.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, Protocol, TypeVar, overload

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend, Device
from burncoll.config import CollectiveConfig
from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.ops import ReduceOp, check_reduce_dtype, parse_reduce_op
from burncoll.work import Work, when_all


class TreeCommunicator(Protocol):
    """What the bucketed tree collectives need of a :class:`burncoll.Communicator`."""

    @property
    def config(self) -> CollectiveConfig: ...

    @property
    def device(self) -> Device: ...

    def all_reduce(self, x: Array, op: ReduceOp | str = ..., *, out: Array | None = ...,
                   async_op: bool = ...) -> Any: ...

    def broadcast(self, x: Array | None, root: int, *, async_op: bool = ...) -> Any: ...

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "LeafSpec", "all_reduce_flat", "all_reduce_tree",
           "broadcast_tree", "flatten_tree", "in_place_ok", "leaf_spec", "leaf_specs", "pack",
           "plan_buckets", "plan_stream_buckets", "unpack_bucket"]

T = TypeVar("T")

#: The default bucket size: 25 MiB, as PyTorch's DistributedDataParallel.
DEFAULT_BUCKET_BYTES = 25 * 2**20

#: Rebuilds a tree of the flattened structure from its leaves, in flattening order.
Unflatten = Callable[[Sequence[Any]], Any]


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """What the bucket plan needs to know about one leaf."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Bucket:
    """Leaves (indices in flattening order) of one dtype that travel as one flat array."""

    dtype: str
    leaves: tuple[int, ...]
    #: Offsets of each leaf in the flat bucket, plus the total size at the end.
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements in the bucket."""
        return self.offsets[-1]

    @classmethod
    def of(cls, dtype: str, leaves: Sequence[int], specs: Sequence[LeafSpec]) -> Bucket:
        """The bucket of ``leaves`` (indices into ``specs``), in that order."""
        offsets = accumulate((specs[i].size for i in leaves), initial=0)
        return cls(dtype, tuple(leaves), tuple(offsets))


# -- trees --------------------------------------------------------------------------------------


def flatten_tree(tree: Any) -> tuple[list[Any], Unflatten]:
    """The leaves of ``tree`` in the deterministic order, and a function rebuilding the tree.

    With jax imported, ``jax.tree_util`` flattens (so any registered pytree works); otherwise
    dicts (keys sorted, so they must be comparable; an ``OrderedDict`` keeps its own order),
    lists, tuples and named tuples are
    containers, ``None`` is an empty subtree, and anything else is a leaf. The rebuilt tree has
    the same container types; its dicts hold their keys in the flattening order, as
    ``jax.tree_util`` rebuilds them.
    """
    if "jax" in sys.modules:
        import jax

        jax_leaves, treedef = jax.tree_util.tree_flatten(tree)

        def unflatten_jax(new_leaves: Sequence[Any]) -> Any:
            return jax.tree_util.tree_unflatten(treedef, list(new_leaves))

        return list(jax_leaves), unflatten_jax
    leaves: list[Any] = []
    build = _flatten(tree, leaves)

    def unflatten(new_leaves: Sequence[Any]) -> Any:
        if len(new_leaves) != len(leaves):
            raise UsageError(f"expected {len(leaves)} leaves, got {len(new_leaves)}")
        return build(iter(new_leaves))

    return leaves, unflatten


_Builder = Callable[[Iterator[Any]], Any]


def _flatten(node: Any, leaves: list[Any]) -> _Builder:
    if node is None:
        return lambda _: None
    if isinstance(node, Mapping):
        try:
            keys = list(node) if isinstance(node, OrderedDict) else sorted(node)
        except TypeError as exc:
            raise UsageError(f"dict keys must be mutually comparable to be sorted: {exc}") from exc
        builders = [_flatten(node[k], leaves) for k in keys]
        kind: Any = type(node)

        def build_dict(it: Iterator[Any]) -> Any:
            items = [(k, b(it)) for k, b in zip(keys, builders, strict=True)]
            if kind is dict:
                return dict(items)
            try:
                return kind(items)
            except TypeError:  # e.g. defaultdict, whose constructor differs: a plain dict
                return dict(items)

        return build_dict
    if isinstance(node, list | tuple):
        children = [_flatten(child, leaves) for child in node]
        kind_seq: Any = type(node)

        def build_seq(it: Iterator[Any]) -> Any:
            values = [b(it) for b in children]
            if kind_seq is list:
                return values
            if kind_seq is tuple:
                return tuple(values)
            if hasattr(kind_seq, "_fields"):  # a named tuple
                return kind_seq(*values)
            return kind_seq(values)

        return build_seq
    leaves.append(node)
    return lambda it: next(it)


# -- the bucket plan ----------------------------------------------------------------------------


def plan_buckets(specs: Sequence[LeafSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> list[Bucket]:
    """Group the leaves ``specs`` into buckets; a pure function of its arguments.

    Leaves are grouped by dtype (dtypes in order of first appearance); within a dtype, leaves
    fill a bucket in flattening order until the next one would take it past ``bucket_bytes``.
    A leaf larger than ``bucket_bytes`` gets a bucket of its own. Every leaf is in exactly one
    bucket. Raises :class:`~burncoll.UsageError` when ``bucket_bytes`` is not a positive int.
    (:func:`plan_stream_buckets`' buckets for leaves ready in flattening order, by dtype.)
    """
    first: dict[str, int] = {}
    for spec in specs:
        first.setdefault(spec.dtype, len(first))
    return sorted(plan_stream_buckets(specs, range(len(specs)), bucket_bytes),
                  key=lambda bucket: first[bucket.dtype])


def plan_stream_buckets(specs: Sequence[LeafSpec], order: Sequence[int],
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Buckets for leaves that become ready in ``order`` (leaf indices), in the order they
    fill up; a pure function of its arguments.

    As DDP's bucket assignment: one open bucket per dtype takes the leaves in ``order`` until
    the next would take it past ``bucket_bytes`` (a larger leaf gets a bucket of its own);
    buckets are ordered by the position of their last leaf in ``order``, i.e. by when they are
    complete when the leaves arrive in ``order``.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise UsageError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if sorted(order) != list(range(len(specs))):
        raise UsageError(f"order must list each of the {len(specs)} leaf indices once, "
                         f"got {list(order)}")
    open_: dict[str, tuple[list[int], int]] = {}
    done: list[tuple[int, str, list[int]]] = []
    last: dict[str, int] = {}
    for position, i in enumerate(order):
        dtype, nbytes = specs[i].dtype, specs[i].nbytes
        leaves, size = open_.get(dtype, ([], 0))
        if leaves and size + nbytes > bucket_bytes:
            done.append((last[dtype], dtype, leaves))
            leaves, size = [], 0
        open_[dtype] = ([*leaves, i], size + nbytes)
        last[dtype] = position
    done += [(last[dtype], dtype, leaves) for dtype, (leaves, _) in open_.items()]
    return [Bucket.of(dtype, leaves, specs)
            for _, dtype, leaves in sorted(done, key=lambda entry: entry[0])]


# -- the collectives ----------------------------------------------------------------------------


@overload
def all_reduce_tree(comm: TreeCommunicator, tree: T, op: ReduceOp | str = ...,
                    bucket_bytes: int = ..., *, async_op: Literal[False] = ...,
                    compression: str | None = ...) -> T: ...


@overload
def all_reduce_tree(comm: TreeCommunicator, tree: T, op: ReduceOp | str = ...,
                    bucket_bytes: int = ..., *, async_op: Literal[True],
                    compression: str | None = ...) -> Work[T]: ...


def all_reduce_tree(comm: TreeCommunicator, tree: T, op: ReduceOp | str = "mean",
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, async_op: bool = False,
                    compression: str | None = None) -> T | Work[T]:
    """``tree`` with every leaf all-reduced over every peer with ``op``; one collective per bucket.

    Every peer must pass a tree of the same structure, leaf dtypes and shapes (as for
    ``all_reduce``), whose leaves are arrays of the communicator's backend. The result has
    the same structure; its leaves are new arrays on this peer's device, bitwise identical on
    every peer. ``op="mean"`` divides by the number of peers of the whole collective (all
    nodes); integer leaves then come back as floats, as with ``all_reduce``. The input is
    not modified. Errors are those of ``Communicator.all_reduce``; a tree whose leaves are not
    arrays raises :class:`~burncoll.UsageError` before anything is sent.

    ``async_op=True``: every bucket's all-reduce is issued with ``async_op=True`` and a
    :class:`~burncoll.Work` is returned at once; its ``wait()`` returns the tree (or raises
    the first failing bucket's error). To reduce buckets while the rest of the gradients is
    still being computed, see :class:`burncoll.train.GradientBuckets`.

    ``compression``: each bucket's ``all_reduce(..., compression=)`` (``None``: the config's,
    which applies to float32/float64 buckets only).
    """
    reduce_op = parse_reduce_op(op)
    # blocking calls leave async_op out, for communicators that predate it
    kw: dict[str, Any] = {"async_op": True} if async_op else {}
    if compression is not None:
        kw["compression"] = compression
    return _bucketed(comm, tree, bucket_bytes,
                     lambda flat, packed: all_reduce_flat(comm, reduce_op, flat, packed, **kw),
                     reduce_op, async_op, "all_reduce_tree")


def all_reduce_flat(comm: TreeCommunicator, op: ReduceOp, flat: Array, packed: bool,
                    **kw: Any) -> Any:
    """``comm.all_reduce`` of a bucket's ``flat`` array; one ``packed`` from several leaves
    is ours, and reduced in place where its dtype allows (no new result)."""
    backend = get_backend(comm.config.backend)
    if packed and in_place_ok(backend, op, backend.dtype_name(flat)):
        return comm.all_reduce(flat, op, out=flat, **kw)
    return comm.all_reduce(flat, op, **kw)


def in_place_ok(backend: Backend, op: ReduceOp, dtype: str) -> bool:
    """Whether an all-reduce with ``op`` may write its result into its ``dtype`` input: the
    backend's arrays are mutable and the result has the input's dtype (not an integer mean)."""
    return backend.mutable and (op is not ReduceOp.MEAN or is_inexact(dtype_from_name(dtype)))


@overload
def broadcast_tree(comm: TreeCommunicator, tree: T, root: int, bucket_bytes: int = ..., *,
                   async_op: Literal[False] = ...) -> T: ...


@overload
def broadcast_tree(comm: TreeCommunicator, tree: T, root: int, bucket_bytes: int = ..., *,
                   async_op: Literal[True]) -> Work[T]: ...


def broadcast_tree(comm: TreeCommunicator, tree: T, root: int,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, async_op: bool = False
                   ) -> T | Work[T]:
    """Peer ``root``'s ``tree`` on every peer; one broadcast per bucket.

    Unlike ``broadcast``, every peer passes a tree: the values of non-root peers are ignored,
    but their structure, dtypes and shapes must match the root's (they fix the bucket plan).
    The result's leaves are new arrays on this peer's device. ``async_op=True``: a
    :class:`~burncoll.Work` whose ``wait()`` returns the tree, as for :func:`all_reduce_tree`.
    """
    kw: dict[str, Any] = {"async_op": True} if async_op else {}
    return _bucketed(comm, tree, bucket_bytes,
                     lambda flat, _packed: comm.broadcast(flat, root, **kw),
                     None, async_op, "broadcast_tree")


def _bucketed(comm: TreeCommunicator, tree: T, bucket_bytes: int,
              collective: Callable[[Array, bool], Any], op: ReduceOp | None, async_op: bool,
              label: str) -> T | Work[T]:
    """Run ``collective(flat, packed)`` per bucket (:func:`pack`); every leaf is checked
    (:func:`leaf_specs`, for ``op`` when given) before the first bucket is sent. With
    ``async_op``, ``collective`` returns Works and so does this."""
    backend = get_backend(comm.config.backend)
    leaves, unflatten = flatten_tree(tree)
    specs = leaf_specs(backend, leaves, op, label)
    out: list[Any] = [None] * len(leaves)
    sent: list[tuple[Bucket, Any]] = []
    for bucket in plan_buckets(specs, bucket_bytes):
        if bucket.size == 0:  # nothing to exchange; every peer skips it alike
            for i in bucket.leaves:
                out[i] = backend.to_device(backend.copy(leaves[i]), comm.device)
            continue
        sent.append((bucket, collective(*pack(backend, bucket, leaves))))

    def assemble(results: list[Array]) -> T:
        for (bucket, _), result in zip(sent, results, strict=True):
            unpack_bucket(backend, bucket, specs, result, out)
        rebuilt: T = unflatten(out)
        return rebuilt

    if async_op:
        return when_all([work for _, work in sent], assemble, label)
    return assemble([result for _, result in sent])


def pack(backend: Backend, bucket: Bucket, leaves: Sequence[Any]) -> tuple[Array, bool]:
    """``bucket``'s leaves as one flat array, and whether it is packed: a new array of
    several leaves (which a collective may overwrite), not a view of the caller's one leaf."""
    flats = [backend.flatten(leaves[i]) for i in bucket.leaves]
    return (flats[0], False) if len(flats) == 1 else (backend.concat(flats), True)


def unpack_bucket(backend: Backend, bucket: Bucket, specs: Sequence[LeafSpec], result: Array,
                  out: list[Any]) -> None:
    """Cut a bucket's flat ``result`` into its leaves' shapes: ``out[i]`` for its leaves
    (views of ``result`` where the backend has views)."""
    if len(bucket.leaves) == 1:
        out[bucket.leaves[0]] = backend.reshape(result, specs[bucket.leaves[0]].shape)
        return
    for k, i in enumerate(bucket.leaves):
        piece = backend.slice(result, bucket.offsets[k], bucket.offsets[k + 1])
        out[i] = backend.reshape(piece, specs[i].shape)


def leaf_specs(backend: Backend, leaves: Sequence[Any], op: ReduceOp | None = None,
               label: str = "") -> list[LeafSpec]:
    """Every leaf's :func:`leaf_spec`; with ``op``, each dtype checked for it (a
    :class:`~burncoll.UsageError` naming the leaf, ``label`` the operation)."""
    specs = [leaf_spec(backend, leaf, i) for i, leaf in enumerate(leaves)]
    for i, spec in enumerate(specs):
        try:
            if op is not None:
                check_reduce_dtype(op, spec.dtype, label)
        except UsageError as exc:
            raise UsageError(f"leaf {i} of the tree: {exc}") from None
    return specs


def leaf_spec(backend: Backend, leaf: Any, index: int) -> LeafSpec:
    """``leaf``'s dtype and shape; a :class:`~burncoll.UsageError` naming leaf ``index`` when
    it is not an array of ``backend``."""
    if not backend.is_array(leaf):
        raise UsageError(f"leaf {index} of the tree is a {type(leaf).__name__}, not an array of "
                         f"backend {backend.name!r}; every leaf must be an array (convert "
                         "scalars first)")
    return LeafSpec(backend.dtype_name(leaf), tuple(backend.shape(leaf)))
