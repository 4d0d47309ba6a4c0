"""The rooted and personalised collectives of :class:`~burncoll.Communicator`: gather,
scatter, all_to_all, scan, exscan, and their object forms; and the ``out=`` arrays they share
with the other collectives.

They run on the same core as every operation (one plan per operation, chosen once:
:class:`~burncoll.local.plans.personal.Personal`); across nodes each block travels straight to
the node that needs it, in one round (:mod:`burncoll.strategies.direct`). ``out=``: an array
of this backend on this peer's device, writable and C-contiguous, of the result's dtype and
shape, which receives the result and is returned (mutable backends only: NumPy, CuPy).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.backends.base import Array, Backend
from burncoll.backends.checks import check_out
from burncoll.comm import objects
from burncoll.comm.core import CommunicatorCore
from burncoll.errors import UsageError
from burncoll.ops import OpKind, ReduceOp, parse_reduce_op

__all__ = ["RootedOps", "parse_counts", "write_out"]


def write_out(backend: Backend, out: Array | None, result: Array | None, label: str
              ) -> Array | None:
    """``result`` written into ``out`` (returned), or ``result`` when there is no ``out`` (or
    no result: a non-root peer's). A dtype or shape other than the result's is a
    :class:`~burncoll.UsageError` (the operation itself completed on every peer)."""
    if out is None or result is None:
        return result
    have = (backend.dtype_name(out), tuple(backend.shape(out)))
    want = (backend.dtype_name(result), tuple(backend.shape(result)))
    if have != want:
        raise UsageError(f"{label}: out is {have[0]}{list(have[1])} but the result is "
                         f"{want[0]}{list(want[1])}; pass an array of the result's dtype and "
                         "shape (the operation itself completed)")
    backend.copy(result, out=out)
    return out


def parse_counts(counts: object, label: str) -> tuple[int, ...] | None:
    """``counts`` (rows per rank) as a tuple of ints, or ``None``; their length and sum are
    checked against the operation when it starts, on every peer at once."""
    if counts is None:
        return None
    items = counts.tolist() if isinstance(counts, np.ndarray) else counts
    if not isinstance(items, Sequence) or isinstance(items, str | bytes) or any(
            isinstance(c, bool | np.bool_) for c in items):
        raise UsageError(f"{label}: counts must be a sequence of ints (rows per rank), got "
                         f"{counts!r}")
    try:
        return tuple(operator.index(c) for c in items)  # ints and NumPy integers
    except TypeError:
        raise UsageError(f"{label}: counts must be a sequence of ints (rows per rank), got "
                         f"{counts!r}") from None


class RootedOps(CommunicatorCore):
    """gather / scatter / all_to_all / scan / exscan and their object forms (a part of
    :class:`~burncoll.Communicator`)."""

    def _rows(self, x: object, label: str) -> None:
        if self._backend.is_array(x) and len(self._backend.shape(x)) == 0:
            raise UsageError(f"{label} needs an array with at least one dimension (rows)")

    def gather(self, x: Array, root: int, *, out: Array | None = None,
               async_op: bool = False) -> Any:
        """Every peer's ``x`` concatenated along axis 0 in rank order, on peer ``root``
        (``None`` elsewhere), like MPI's ``Gatherv``: peers may pass different lengths along
        axis 0; dtype and trailing shape must agree. ``out=`` applies on the root."""
        root = self._check_root(root)
        self._rows(x, "gather")
        if out is not None and root == self.peer_id:
            check_out(self._backend, self.device, out, "gather")
        mine = out if root == self.peer_id else None
        return self._issue("gather", lambda: write_out(
            self._backend, mine, self._run(OpKind.GATHER, x, None, root), "gather"), async_op)

    def scatter(self, x: Array | None, root: int, counts: Sequence[int] | None = None, *,
                out: Array | None = None, async_op: bool = False) -> Any:
        """Block ``r`` of peer ``root``'s ``x`` on the peer of rank ``r``: ``x`` is cut along
        axis 0 as ``numpy.array_split(x, world_size)`` cuts it, or into ``counts[r]`` rows
        for rank ``r`` (one count per rank, summing to ``x``'s rows; only the root's
        ``counts`` and ``x`` are read, others may pass ``None``)."""
        root = self._check_root(root)
        mine = x if root == self.peer_id else None
        if root == self.peer_id:
            if x is None:
                raise UsageError(f"scatter: the root (peer {root}) must pass an array")
            self._rows(x, "scatter")
        parsed = parse_counts(counts, "scatter") if root == self.peer_id else None
        if out is not None:
            check_out(self._backend, self.device, out, "scatter")
        return self._issue("scatter", lambda: write_out(self._backend, out, self._run(
            OpKind.SCATTER, mine, None, root, allow_none=True, counts=parsed), "scatter"),
            async_op)

    def all_to_all(self, x: Array, send_counts: Sequence[int] | None = None, *,
                   out: Array | None = None, async_op: bool = False) -> Any:
        """Block ``d`` of this peer's ``x`` to the peer of rank ``d``; returns the blocks
        every peer sent this one, concatenated along axis 0 in rank order (MPI's
        ``Alltoallv``, torch's ``all_to_all_single``). ``x`` is cut as
        ``numpy.array_split(x, world_size)`` cuts it, or into ``send_counts[d]`` rows for
        rank ``d``; each peer may pass its own counts. dtype and trailing shape must agree."""
        self._rows(x, "all_to_all")
        parsed = parse_counts(send_counts, "all_to_all")
        if out is not None:
            check_out(self._backend, self.device, out, "all_to_all")
        return self._issue("all_to_all", lambda: write_out(self._backend, out, self._run(
            OpKind.ALL_TO_ALL, x, None, None, counts=parsed), "all_to_all"), async_op)

    def scan(self, x: Array, op: ReduceOp | str = "sum", *, async_op: bool = False) -> Any:
        """The inclusive prefix reduction: ``x`` of ranks ``0 .. rank`` combined with ``op``
        in rank order (MPI's ``Scan``); every peer passes an array of the same dtype and
        shape. The mean divides by ``rank + 1``."""
        reduce_op = parse_reduce_op(op)
        return self._issue("scan", lambda: self._run(OpKind.SCAN, x, reduce_op, None),
                           async_op)

    def exscan(self, x: Array, op: ReduceOp | str = "sum", *, async_op: bool = False) -> Any:
        """The exclusive prefix reduction: ``x`` of ranks ``0 .. rank - 1`` combined with
        ``op`` in rank order (MPI's ``Exscan``); ``None`` on rank 0, as in mpi4py."""
        reduce_op = parse_reduce_op(op)
        return self._issue("exscan", lambda: self._run(OpKind.EXSCAN, x, reduce_op, None),
                           async_op)

    def gather_object(self, obj: object, root: int) -> list[object] | None:
        """Every peer's ``obj`` in rank order on peer ``root`` (``None`` elsewhere), torch's
        ``gather_object``; msgpack, never pickle (:mod:`burncoll.comm.objects` says what may go).

        Two collectives: a small all-gather of whether each peer could encode its object (so
        a refused object raises :class:`~burncoll.UsageError` on every peer, naming it), then
        the gather of the encodings."""
        root = self._check_root(root)
        record = objects.payload(obj, cap=self.config.max_object_containers)
        self._all_gather_record(record if objects.is_refusal(record) else objects.payload(None),
                                "gather_object")  # whether each peer's object could go
        backend, device = self._backend, self.device
        got = self.gather(backend.from_host(record, "uint8", record.shape, device), root)
        if got is None:
            return None
        return objects.unpack(backend.to_host(got), self.peer_ids, "gather_object",
                              self.config.max_object_containers)

    def scatter_object(self, objs: Sequence[object] | None, root: int) -> object:
        """``objs[r]`` of peer ``root`` on the peer of rank ``r`` (others pass ``None``),
        torch's ``scatter_object_list`` returning this peer's object; msgpack, never pickle.
        An object that cannot be sent raises :class:`~burncoll.UsageError` on every peer."""
        root = self._check_root(root)
        mine: Array | None = None
        counts: list[int] | None = None
        if root == self.peer_id:
            if not isinstance(objs, list | tuple) or len(objs) != len(self.peer_ids):
                raise UsageError(f"scatter_object: the root must pass a list of "
                                 f"{len(self.peer_ids)} objects (one per rank), got {objs!r}")
            cap = self.config.max_object_containers
            records = [objects.payload(o, cap=cap) for o in objs]
            bad = next((r for r in records if objects.is_refusal(r)), None)
            if bad is not None:  # every peer gets the refusal, and raises it
                records = [bad] * len(records)
            counts = [len(r) for r in records]
            data = np.concatenate(records)
            mine = self._backend.from_host(data, "uint8", data.shape, self.device)
        got = self.scatter(mine, root, counts)
        return objects.unpack(self._backend.to_host(got), [root], "scatter_object",
                              self.config.max_object_containers)[0]
