"""``Personal``: the rooted and personalised collectives, computed at arrival in host memory.

gather, scatter, all_to_all, scan, exscan, and reduce_scatter with explicit ``counts``: each
peer's result is made of *other* peers' blocks, so nothing is combined on the way. The last
local peer to arrive copies every local input to host memory, cuts it into its blocks, runs the
direct schedule with the other nodes (:mod:`burncoll.strategies.direct`: every block straight
to the node that needs it, in one round), computes every local peer's result with NumPy -- a
reduction always in rank order -- and hands each peer a new array on its device. The results
are therefore the same on every backend, and a scan's are reduced in the same order wherever
they are computed.

Counts are checked here, in the last peer to arrive, against every local call: a wrong sum or
length fails the operation on every peer of every node (the abort carries the error), never
only on the peer that passed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from burncoll.backends.numpy import host_ufunc
from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.levels import HostArray
from burncoll.local.calls import Call
from burncoll.local.plans.inline import InlineResults
from burncoll.local.plans.phases import global_op, link_of
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Schedule
from burncoll.strategies.direct import (
    all_to_all_schedule,
    gather_schedule,
    prefix_schedule,
    scatter_schedule,
)

__all__ = ["PERSONAL_KINDS", "Personal", "block_counts"]

#: The operations this plan runs (and a reduce-scatter given ``counts``).
PERSONAL_KINDS = frozenset({OpKind.GATHER, OpKind.SCATTER, OpKind.ALL_TO_ALL, OpKind.SCAN,
                            OpKind.EXSCAN})
#: The kinds whose chunks are indexed ``src * ranks + dst``.
_PAIRWISE = (OpKind.ALL_TO_ALL, OpKind.REDUCE_SCATTER)


@dataclass(frozen=True, slots=True)
class Personal:
    """Every local peer's result, computed by the last peer to arrive."""

    def prepare(self, rv: Rendezvous, state: OpState) -> InlineResults:
        calls = state.complete_calls()
        for call in calls:
            block_counts(call, rv.world_size)  # refuse bad counts before anything moves
        chunks = _local_chunks(rv, calls)
        if rv.world.multi_node:
            deadline = state.started + rv.config.timeout
            link_of(rv).route(global_op(state, deadline), _schedule(rv, calls[0]), chunks)
        backend = rv.backend
        results: list[object] = []
        for index, mine in enumerate(state.calls):
            assert mine is not None  # every local peer arrived
            result = _result(mine, rv.rank_of[mine.peer_id], rv.world_size, chunks)
            results.append(None if result is None else backend.from_host(
                result, result.dtype.name, tuple(result.shape), rv.devices[index]))
        return InlineResults(results)


def block_counts(call: Call, ranks: int) -> tuple[int, ...]:
    """The rows of each of the ``ranks`` blocks ``call``'s array is cut into: its ``counts``
    (checked: one per rank, non-negative, summing to the array's rows), else
    ``numpy.array_split``'s. :class:`~burncoll.UsageError` naming the peer otherwise."""
    rows = (call.shape or (0,))[0]
    if call.counts is None:
        base, extra = divmod(rows, ranks)
        return tuple(base + (1 if i < extra else 0) for i in range(ranks))
    counts = call.counts
    where = f"{call.kind.label}: peer {call.peer_id}'s counts {list(counts)}"
    if len(counts) != ranks:
        raise UsageError(f"{where} has {len(counts)} entries; give one per rank ({ranks})")
    if any(c < 0 for c in counts):
        raise UsageError(f"{where} has a negative entry; counts are rows per rank (>= 0)")
    if sum(counts) != rows:
        raise UsageError(f"{where} sum to {sum(counts)}, but its array has {rows} rows "
                         f"(shape {list(call.shape or ())}); they must add up to the rows")
    return counts


def _blocks(call: Call, host: HostArray, ranks: int) -> list[HostArray]:
    """``host`` cut along axis 0 into the blocks of :func:`block_counts` (views)."""
    bounds = np.cumsum((0, *block_counts(call, ranks)))
    return [host[int(a):int(b)] for a, b in itertools.pairwise(bounds)]


def _local_chunks(rv: Rendezvous, calls: Sequence[Call]) -> list[HostArray | None]:
    """The chunks this node holds before anything moves (the others ``None``, or, for a
    reduce-scatter with counts, flat buffers of the size every peer agreed on)."""
    ranks = rv.world_size
    kind = calls[0].kind
    chunks: list[HostArray | None] = [None] * (ranks * ranks if kind in _PAIRWISE else ranks)
    for call in calls:
        if call.array is None:
            continue
        rank = rv.rank_of[call.peer_id]
        host = np.ascontiguousarray(rv.backend.to_host(call.array)).reshape(call.shape or ())
        if kind is OpKind.GATHER:
            chunks[rank] = host
        elif kind in (OpKind.SCAN, OpKind.EXSCAN):
            chunks[rank] = host.reshape(1, *host.shape)
        elif kind is OpKind.SCATTER:
            chunks[:] = _blocks(call, host, ranks)
        else:
            for dst, block in enumerate(_blocks(call, host, ranks)):
                chunks[rank * ranks + dst] = block
    if kind is OpKind.REDUCE_SCATTER and rv.world.multi_node:
        _room_for_blocks(rv, calls[0], chunks)
    return chunks


def _room_for_blocks(rv: Rendezvous, call: Call, chunks: list[HostArray | None]) -> None:
    """A reduce-scatter's receivers know each block's size (every peer passed the same
    counts): the blocks other nodes send are received into buffers of exactly that size."""
    ranks = rv.world_size
    counts = block_counts(call, ranks)
    row = int(np.prod((call.shape or (0,))[1:], dtype=np.int64))
    dtype = dtype_from_name(call.dtype or "uint8")
    for peer in rv.peer_ids:
        dst = rv.rank_of[peer]
        for src in range(ranks):
            if chunks[src * ranks + dst] is None:
                chunks[src * ranks + dst] = np.empty(counts[dst] * row, dtype)


def _schedule(rv: Rendezvous, call: Call) -> Schedule:
    world = rv.world
    owners = tuple(world.node_of[p] for p in world.all_peer_ids)
    kind = call.kind
    if kind is OpKind.GATHER:
        return gather_schedule(world.num_nodes, owners, world.node_of[call.root or 0])
    if kind is OpKind.SCATTER:
        return scatter_schedule(world.num_nodes, owners, world.node_of[call.root or 0])
    if kind in (OpKind.SCAN, OpKind.EXSCAN):
        return prefix_schedule(world.num_nodes, owners)
    return all_to_all_schedule(world.num_nodes, owners)


def _result(call: Call, rank: int, ranks: int, chunks: list[HostArray | None]
            ) -> HostArray | None:
    """Rank ``rank``'s result from every chunk this node now holds (a new array)."""
    kind = call.kind
    held = chunks
    if kind is OpKind.GATHER:
        return None if call.peer_id != call.root else np.concatenate(_all(held), axis=0)
    if kind is OpKind.SCATTER:
        return np.array(_one(held[rank]), copy=True)
    column = [_one(held[src * ranks + rank]) for src in range(ranks)] if kind in _PAIRWISE \
        else []
    if kind is OpKind.ALL_TO_ALL:
        return np.concatenate(column, axis=0)
    op = call.reduce_op or ReduceOp.SUM
    if kind is OpKind.REDUCE_SCATTER:
        shape = (block_counts(call, ranks)[rank], *(call.shape or (0,))[1:])
        return _reduce([c.reshape(shape) for c in column], op)
    prefix = [_one(c)[0] for c in held[:rank + (1 if kind is OpKind.SCAN else 0)]]
    return _reduce(prefix, op) if prefix else None  # exscan: nothing before rank 0


def _one(chunk: HostArray | None) -> HostArray:
    if chunk is None:  # pragma: no cover - the schedule delivers every chunk a rank needs
        raise RuntimeError("a block this node needs did not arrive")
    return chunk


def _all(chunks: Sequence[HostArray | None]) -> list[HostArray]:
    return [_one(c) for c in chunks]


def _reduce(blocks: Sequence[HostArray], op: ReduceOp) -> HostArray:
    """``blocks`` combined with ``op`` in order (a new array); the mean divides the sum by
    their number, integers and bool becoming float64 as in every other mean."""
    acc = np.array(blocks[0], copy=True)
    ufunc = host_ufunc(op)
    for block in blocks[1:]:
        ufunc(acc, block, out=acc)
    if op is ReduceOp.MEAN:
        dtype = acc.dtype if is_inexact(acc.dtype) else np.dtype(np.float64)
        acc = np.asarray(np.divide(acc, len(blocks), dtype=dtype))
    return acc
