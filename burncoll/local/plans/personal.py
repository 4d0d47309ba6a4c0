"""``Personal``: the rooted and personalised collectives, computed at arrival in host memory.

gather, scatter, all_to_all, scan, exscan, and reduce_scatter with explicit ``counts``: each
peer's result is made of *other* peers' blocks, so nothing is combined on the way. The last
local peer to arrive copies every local input to host memory, cuts it into its blocks, runs the
direct schedule with the other nodes (:mod:`burncoll.strategies.direct`: every block straight
to the node that needs it, in one round), computes every local peer's result with NumPy, and
hands each peer a new array on its device. The results are therefore the same on every
backend, and a scan's are reduced in rank order wherever they are computed. A reduce-scatter
combines on the node first: its local peers' blocks for each rank, in rank order, become one
block (sent once to that rank's node, however many devices this node has), and each rank's
result combines the nodes' blocks in node order (a mean divides by the ranks at the end).

Counts are checked here, in the last peer to arrive, against every local call: a wrong sum or
length fails the operation on every peer of every node (the abort carries the error), never
only on the peer that passed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.levels import HostArray
from burncoll.local.calls import Call
from burncoll.local.plans.inline import InlineResults
from burncoll.local.plans.phases import global_op, link_of
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import OpKind, ReduceOp
from burncoll.reduction import reduce_into
from burncoll.strategies import Schedule
from burncoll.strategies.direct import (
    all_to_all_schedule,
    first_ranks,
    gather_schedule,
    prefix_schedule,
    reduce_scatter_schedule,
    scatter_schedule,
)

__all__ = ["PERSONAL_KINDS", "Personal", "block_counts"]

#: The operations this plan runs (and a reduce-scatter given ``counts``).
PERSONAL_KINDS = frozenset({OpKind.GATHER, OpKind.SCATTER, OpKind.ALL_TO_ALL, OpKind.SCAN,
                            OpKind.EXSCAN})


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
        sources = _sources(rv, calls[0].kind)
        results: list[object] = []
        for index, mine in enumerate(state.calls):
            assert mine is not None  # every local peer arrived
            result = _result(mine, rv.rank_of[mine.peer_id], rv.world_size, sources, chunks)
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


def _owners(rv: Rendezvous) -> tuple[int, ...]:
    """Each rank's node."""
    world = rv.world
    return tuple(world.node_of[p] for p in world.all_peer_ids)


def _sources(rv: Rendezvous, kind: OpKind) -> tuple[int, ...]:
    """The source ranks whose chunks ``src * ranks + dst`` make rank ``dst``'s result: every
    rank for an all-to-all, each node's first rank for a reduce-scatter (its combined
    blocks); none for the other kinds."""
    if kind is OpKind.ALL_TO_ALL:
        return tuple(range(rv.world_size))
    if kind is OpKind.REDUCE_SCATTER:
        return tuple(first_ranks(rv.world.num_nodes, _owners(rv)).values())
    return ()


def _host(rv: Rendezvous, call: Call) -> HostArray:
    assert call.array is not None  # (the callers skip the peers that pass none)
    return np.ascontiguousarray(rv.backend.to_host(call.array)).reshape(call.shape or ())


def _local_chunks(rv: Rendezvous, calls: Sequence[Call]) -> list[HostArray | None]:
    """The chunks this node holds before anything moves (the others ``None``, or, for a
    reduce-scatter, buffers for what the other nodes send)."""
    ranks = rv.world_size
    kind = calls[0].kind
    if kind is OpKind.REDUCE_SCATTER:
        return _combined_blocks(rv, calls)
    chunks: list[HostArray | None] = [None] * (ranks * ranks if kind is OpKind.ALL_TO_ALL
                                               else ranks)
    for call in calls:
        if call.array is None:
            continue
        rank = rv.rank_of[call.peer_id]
        host = _host(rv, call)
        if kind is OpKind.GATHER:
            chunks[rank] = host
        elif kind in (OpKind.SCAN, OpKind.EXSCAN):
            chunks[rank] = host.reshape(1, *host.shape)
        elif kind is OpKind.SCATTER:
            chunks[:] = _blocks(call, host, ranks)
        else:
            for dst, block in enumerate(_blocks(call, host, ranks)):
                chunks[rank * ranks + dst] = block
    return chunks


def _combined_blocks(rv: Rendezvous, calls: Sequence[Call]) -> list[HostArray | None]:
    """A reduce-scatter's chunks: this node's blocks for each rank ``d``, combined in rank
    order (a mean sums), at ``f * ranks + d`` (``f``: this node's first rank), and, for each
    rank of this node, an empty block of the size every peer agreed on for each other node's
    (they send exactly that; nothing is sized by what arrives)."""
    ranks = rv.world_size
    world = rv.world
    first = first_ranks(world.num_nodes, _owners(rv))
    ordered = sorted(calls, key=lambda c: rv.rank_of[c.peer_id])
    blocks = [_blocks(c, _host(rv, c), ranks) for c in ordered]
    op = calls[0].reduce_op or ReduceOp.SUM
    chunks: list[HostArray | None] = [None] * (ranks * ranks)
    mine = first[world.node_index]
    for dst in range(ranks):
        column = [b[dst] for b in blocks]
        chunks[mine * ranks + dst] = _combine(column, op) if len(column) > 1 else column[0]
    counts = block_counts(calls[0], ranks)
    row = int(np.prod((calls[0].shape or (0,))[1:], dtype=np.int64))
    dtype = dtype_from_name(calls[0].dtype or "uint8")
    for call in calls:
        dst = rv.rank_of[call.peer_id]
        for node, f in first.items():
            if node != world.node_index:
                chunks[f * ranks + dst] = np.empty(counts[dst] * row, dtype)
    return chunks


def _schedule(rv: Rendezvous, call: Call) -> Schedule:
    world = rv.world
    owners = _owners(rv)
    kind = call.kind
    if kind is OpKind.GATHER:
        return gather_schedule(world.num_nodes, owners, world.node_of[call.root or 0])
    if kind is OpKind.SCATTER:
        return scatter_schedule(world.num_nodes, owners, world.node_of[call.root or 0])
    if kind in (OpKind.SCAN, OpKind.EXSCAN):
        return prefix_schedule(world.num_nodes, owners)
    if kind is OpKind.REDUCE_SCATTER:
        return reduce_scatter_schedule(world.num_nodes, owners)
    return all_to_all_schedule(world.num_nodes, owners)


def _result(call: Call, rank: int, ranks: int, sources: tuple[int, ...],
            chunks: list[HostArray | None]) -> HostArray | None:
    """Rank ``rank``'s result from every chunk this node now holds (a new array);
    ``sources`` as :func:`_sources` gives them."""
    kind = call.kind
    held = chunks
    if kind is OpKind.GATHER:
        return None if call.peer_id != call.root else np.concatenate(_all(held), axis=0)
    if kind is OpKind.SCATTER:
        return np.array(_one(held[rank]), copy=True)
    column = [_one(held[src * ranks + rank]) for src in sources]
    if kind is OpKind.ALL_TO_ALL:
        return np.concatenate(column, axis=0)
    op = call.reduce_op or ReduceOp.SUM
    if kind is OpKind.REDUCE_SCATTER:
        shape = (block_counts(call, ranks)[rank], *(call.shape or (0,))[1:])
        return _reduce([c.reshape(shape) for c in column], op, ranks)
    prefix = [_one(c)[0] for c in held[:rank + (1 if kind is OpKind.SCAN else 0)]]
    return _reduce(prefix, op, len(prefix)) if prefix else None  # exscan: nothing before 0


def _one(chunk: HostArray | None) -> HostArray:
    if chunk is None:  # pragma: no cover - the schedule delivers every chunk a rank needs
        raise RuntimeError("a block this node needs did not arrive")
    return chunk


def _all(chunks: Sequence[HostArray | None]) -> list[HostArray]:
    return [_one(c) for c in chunks]


def _combine(blocks: Sequence[HostArray], op: ReduceOp) -> HostArray:
    """``blocks`` combined with ``op`` in order (a new array; a mean sums)."""
    return reduce_into(op, blocks, np.empty_like(blocks[0], order="C"))


def _reduce(blocks: Sequence[HostArray], op: ReduceOp, count: int) -> HostArray:
    """``blocks`` combined with ``op`` in order (a new array); the mean divides the sum by
    ``count`` (the values it adds up), integers and bool becoming float64 as in every other
    mean."""
    acc = _combine(blocks, op)
    if op is ReduceOp.MEAN:
        dtype = acc.dtype if is_inexact(acc.dtype) else np.dtype(np.float64)
        acc = np.asarray(np.divide(acc, count, dtype=dtype))
    return acc
