"""``HierarchicalRing``: an all-reduce sharded across nodes that all run a local ring.

A local reduce-scatter leaves local peer ``i`` with shard ``i`` of the node's reduction; every
local peer all-reduces its shard with the same-index peer of every other node (one channel
per shard, concurrently); a local all-gather hands every peer every shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from burncoll.backends.base import Array
from burncoll.levels import Route
from burncoll.local.buffers import ChunkBuffer
from burncoll.local.plans import phases
from burncoll.local.plans.phases import (
    count,
    finish_reduce,
    first_call,
    global_op,
    link_of,
    new_buffers,
    peer_call,
    walk,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy
from burncoll.strategies.layout import even_layout

__all__ = ["HierarchicalRing", "HierarchicalRingRun"]


@dataclass(frozen=True, slots=True)
class HierarchicalRing:
    """``strategy``: the local reduce-scatter's and all-gather's; ``routes[i]``: the route
    of shard ``i``'s global all-reduce (each shard chosen by its own size)."""

    strategy: Strategy
    routes: tuple[Route, ...]

    def prepare(self, rv: Rendezvous, state: OpState) -> HierarchicalRingRun:
        call = first_call(state)
        layout = even_layout(count(call.shape), rv.size)
        buffers = new_buffers(rv, state, call.dtype or "float32", layout, True)
        return HierarchicalRingRun(self, rv, state, buffers)


@dataclass(frozen=True, slots=True)
class HierarchicalRingRun:
    plan: HierarchicalRing
    rv: Rendezvous
    state: OpState
    #: Every local peer's buffer, one shard per local peer.
    buffers: list[ChunkBuffer]

    def run(self, index: int, deadline: float) -> Array:
        rv, state, buffers = self.rv, self.state, self.buffers
        call = peer_call(state, index)
        backend = rv.backend
        strategy = self.plan.strategy
        walk(rv, state, index, deadline, phases.reduce_scatter_steps(strategy, rv.size),
             buffers, call.reduce_op, "local reduce-scatter")
        mine = buffers[index]
        shard = mine.own(index)
        host = backend.to_host(shard)
        in_place = backend.mutable and host.flags.writeable and host.flags.c_contiguous
        if not in_place:
            host = np.array(host, copy=True, order="C")
        link_of(rv).all_reduce(global_op(state, deadline), host, channel=index,
                               route=self.plan.routes[index])
        if not in_place:
            mine.assign(index, backend.from_host(host, call.dtype or "float32", (host.size,),
                                                 mine.device))
        rv.sync(state, index, deadline, "global all_reduce of shards")
        walk(rv, state, index, deadline, phases.all_gather_steps(strategy, rv.size),
             buffers, None, "local all-gather")
        result = backend.reshape(mine.result(), call.shape or ())
        return finish_reduce(rv, result, call.reduce_op)
