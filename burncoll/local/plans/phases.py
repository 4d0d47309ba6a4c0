"""What several plans share: their buffers, the operation as the nodes see it, the host copy
handed to the global level, the mean's division, the local reduce and broadcast phases, and
the local schedules indexed for the peer threads with the walk of one peer through one.

Schedules are pure values of (strategy, world, root), so each index is built once per process.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from burncoll.backends.base import Array, Backend
from burncoll.compression import root_code
from burncoll.levels import GlobalLink, GlobalOp, HostArray
from burncoll.local.buffers import ChunkBuffer
from burncoll.local.calls import Call
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Action, Schedule, Step, Strategy
from burncoll.strategies.base import default_owners
from burncoll.strategies.layout import Layout, even_layout

__all__ = ["LocalBroadcast", "LocalReduce", "StepIndex", "all_gather_steps", "all_reduce_steps",
           "broadcast_steps", "count", "finish_reduce", "first_call", "flat_input", "global_op",
           "link_of", "new_buffers", "peer_call", "reduce_scatter_steps", "reduce_steps", "walk",
           "writable_host"]


_CACHED = 256


@dataclass(frozen=True, slots=True)
class StepIndex:
    """A schedule with each participant's incoming steps indexed by round."""

    schedule: Schedule
    #: ``steps_into[participant][round]``
    steps_into: tuple[tuple[tuple[Step, ...], ...], ...]

    @classmethod
    def of(cls, schedule: Schedule) -> StepIndex:
        rounds = range(len(schedule.rounds))
        return cls(schedule, tuple(tuple(schedule.steps_into(p, r) for r in rounds)
                                   for p in range(schedule.world)))


@functools.lru_cache(maxsize=_CACHED)
def reduce_steps(strategy: Strategy, world: int, root: int) -> StepIndex:
    return StepIndex.of(strategy.reduce(world, root))


@functools.lru_cache(maxsize=_CACHED)
def broadcast_steps(strategy: Strategy, world: int, root: int) -> StepIndex:
    return StepIndex.of(strategy.broadcast(world, root))


@functools.lru_cache(maxsize=_CACHED)
def all_reduce_steps(strategy: Strategy, world: int) -> StepIndex:
    return StepIndex.of(strategy.all_reduce(world))


@functools.lru_cache(maxsize=_CACHED)
def reduce_scatter_steps(strategy: Strategy, world: int) -> StepIndex:
    """Chunk ``i`` reduced into participant ``i``."""
    return StepIndex.of(strategy.reduce_scatter(world, default_owners(world)))


@functools.lru_cache(maxsize=_CACHED)
def all_gather_steps(strategy: Strategy, world: int) -> StepIndex:
    """Chunk ``i`` from participant ``i`` to every participant."""
    return StepIndex.of(strategy.all_gather(world, default_owners(world)))


def walk(
    rv: Rendezvous, state: OpState, index: int, deadline: float, steps: StepIndex,
    buffers: list[ChunkBuffer], op: ReduceOp | None, label: str,
) -> None:
    """Walk ``steps`` as participant ``index``: apply the steps into it, round by round,
    meeting the other local peers after each round."""
    backend: Backend = rv.backend
    mine = buffers[index]
    rounds = steps.steps_into[index]
    for r, into in enumerate(rounds):
        for step in into:
            other = backend.to_device(buffers[step.src].chunk(step.chunk), mine.device)
            if step.action is Action.REDUCE and op is not None:
                mine.reduce(step.chunk, other, op)
            else:
                mine.assign(step.chunk, other)
        rv.sync(state, index, deadline, f"{label} round {r + 1}/{len(rounds)}")


def count(shape: tuple[int, ...] | None) -> int:
    """The number of elements of an array of ``shape``."""
    return math.prod(shape or ())


def first_call(state: OpState) -> Call:
    """The call every peer's call agrees with (the calls are compared before preparing)."""
    call = state.calls[0]  # (every peer has arrived once the operation is prepared)
    return call if call is not None else state.complete_calls()[0]


def peer_call(state: OpState, index: int) -> Call:
    call = state.calls[index]
    if call is None:  # pragma: no cover - the peer arrived with it
        raise RuntimeError("peer has no call")
    return call


def flat_input(rv: Rendezvous, call: Call) -> Array:
    return rv.backend.flatten(call.array)


def new_buffers(
    rv: Rendezvous, state: OpState, dtype: str, layout: Layout, with_input: bool
) -> list[ChunkBuffer]:
    """A buffer per local peer over ``layout``; ``with_input``: over the peer's input."""
    return [
        ChunkBuffer(
            rv.backend, rv.devices[i], dtype, layout,
            flat_input(rv, c) if with_input and c is not None and c.array is not None else None,
        )
        for i, c in enumerate(state.calls)
    ]


def finish_reduce(rv: Rendezvous, x: Array, op: ReduceOp | None) -> Array:
    """``x`` divided by the world size for a mean (reductions sum until then)."""
    if op is ReduceOp.MEAN:
        return rv.backend.scale(x, rv.world_size)
    return x


def global_op(state: OpState, deadline: float) -> GlobalOp:
    """The operation as the nodes see it (the shape without its rows where chunks carry
    their own: all-gather, gather, all-to-all, scatter; a scan's chunk is one row of the
    call's shape; a scatter receiver's node knows neither dtype nor shape)."""
    call = first_call(state)
    dtype: str | None
    shape: tuple[int, ...]
    if call.kind is OpKind.SCATTER:
        call = next((c for c in state.complete_calls() if c.array is not None), call)
    if call.kind is OpKind.BROADCAST or (call.kind is OpKind.SCATTER and call.array is None):
        dtype, shape = None, ()
    elif call.kind in (OpKind.ALL_GATHER, OpKind.GATHER, OpKind.ALL_TO_ALL, OpKind.SCATTER):
        dtype, shape = call.dtype, (call.shape or ())[1:]
    else:
        dtype, shape = call.dtype, call.shape or ()
    root = -1 if call.root is None else call.root
    if call.kind is OpKind.REDUCE_SCATTER and call.counts is not None:
        root = counts_digest(call.counts)  # (no root): nodes that disagree on counts mismatch
    if call.kind is OpKind.ALL_REDUCE and call.compression is not None:
        root = root_code(call.compression)  # (no root either): read back by op.compression
    return GlobalOp(
        seq=state.seq, kind=call.kind, reduce_op=call.reduce_op, dtype=dtype, shape=shape,
        root=root, deadline=deadline, started=state.started,
    )


def counts_digest(counts: tuple[int, ...]) -> int:
    """A reduce-scatter's explicit counts as a non-negative 62-bit number, carried in the
    frames' root field: a node whose counts differ fails with a MismatchError, before any
    size check."""
    text = ",".join(map(str, counts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def writable_host(rv: Rendezvous, flat: Array) -> HostArray:
    """``flat`` in host memory, writable and C-contiguous (a copy only where needed)."""
    host = rv.backend.to_host(flat)
    if not host.flags.writeable or not host.flags.c_contiguous:
        host = np.array(host, copy=True, order="C")
    return host


def link_of(rv: Rendezvous) -> GlobalLink:
    if rv.link is None:  # pragma: no cover - only multi-node plans ask
        raise RuntimeError("no global link")
    return rv.link


class LocalReduce:
    """The first phase of a multi-node operation: the local peers' inputs reduced into the
    leader's buffer by a local schedule (the leader then takes it to the other nodes)."""

    def __init__(self, rv: Rendezvous, state: OpState, strategy: Strategy, leader: int
                 ) -> None:
        call = first_call(state)
        self._rv = rv
        self._state = state
        self._steps = reduce_steps(strategy, rv.size, leader)
        layout = even_layout(count(call.shape), self._steps.schedule.num_chunks)
        self._buffers = new_buffers(rv, state, call.dtype or "float32", layout, True)
        self._leader = leader

    def run(self, index: int, deadline: float, op: ReduceOp | None) -> None:
        walk(self._rv, self._state, index, deadline, self._steps, self._buffers, op,
             "local reduce")

    def host(self) -> HostArray:
        """The node's reduction, for the leader to hand to the global level."""
        return writable_host(self._rv, self._buffers[self._leader].result())


class LocalBroadcast:
    """The last phase of a multi-node operation: a flat array held by one local peer (the
    result of the global part) broadcast to the others by a local schedule."""

    def __init__(self, rv: Rendezvous, state: OpState, steps: StepIndex) -> None:
        self._rv = rv
        self._state = state
        self._steps = steps
        #: Built by the broadcasting peer once it holds the array.
        self._buffers: list[ChunkBuffer] | None = None

    def run(self, index: int, deadline: float, root: int, flat_on_root: Array | None,
            dtype: str, owned: bool = False) -> Array:
        """Peer ``index``'s copy of ``flat_on_root`` (which only peer ``root`` passes).

        ``owned``: the array is burncoll's own (not the caller's input), so the root may return
        it as its result instead of a copy.
        """
        rv = self._rv
        if index == root:
            if flat_on_root is None:  # pragma: no cover
                raise RuntimeError("local broadcast root has nothing to send")
            layout = even_layout(rv.backend.shape(flat_on_root)[0],
                                 self._steps.schedule.num_chunks)
            self._buffers = [
                ChunkBuffer(rv.backend, rv.devices[i], dtype, layout,
                            flat_on_root if i == root else None)
                for i in range(rv.size)
            ]
        rv.sync(self._state, index, deadline, "local broadcast setup")
        buffers = self._buffers
        if buffers is None:  # pragma: no cover - the root built them before the sync
            raise RuntimeError("local broadcast buffers missing")
        walk(rv, self._state, index, deadline, self._steps, buffers, None, "local broadcast")
        if owned and index == root and flat_on_root is not None:
            return flat_on_root  # never written during a broadcast; the last round has synced
        return buffers[index].result()
