"""``GlobalAllGather``: an all-gather across nodes. Local peer 0 gathers every peer's array
across the nodes (its node's arrays by rank), then broadcasts the whole to its local peers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from burncoll.backends.base import Array
from burncoll.local.plans import steps as steps_of
from burncoll.local.plans.phases import (
    LocalBroadcast,
    global_op,
    link_of,
    peer_call,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy

__all__ = ["GlobalAllGather", "GlobalAllGatherRun"]

#: The local peer that gathers across the nodes.
_GATHERER = 0


@dataclass(frozen=True, slots=True)
class GlobalAllGather:
    """``strategy``: the local broadcast's; ``global_strategy``: the global all-gather's."""

    strategy: Strategy
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalAllGatherRun:
        steps = steps_of.broadcast_steps(self.strategy, rv.size, _GATHERER)
        return GlobalAllGatherRun(self, rv, state, LocalBroadcast(rv, state, steps))


@dataclass(slots=True)
class GlobalAllGatherRun:
    plan: GlobalAllGather
    rv: Rendezvous
    state: OpState
    local_broadcast: LocalBroadcast
    #: Every peer's array, concatenated, flat on the gatherer's device, and its shape.
    flat: Array | None = field(default=None)
    shape: tuple[int, ...] = ()

    def run(self, index: int, deadline: float) -> Array:
        rv = self.rv
        call = peer_call(self.state, index)
        dtype = call.dtype or "float32"
        if index == _GATHERER:
            self._across_nodes(index, deadline, dtype)
        rv.sync(self.state, index, deadline, "global all_gather")
        out = self.local_broadcast.run(index, deadline, _GATHERER, self.flat, dtype,
                                       owned=True)
        return rv.backend.reshape(out, self.shape)

    def _across_nodes(self, index: int, deadline: float, dtype: str) -> None:
        rv, backend = self.rv, self.rv.backend
        calls = self.state.complete_calls()
        trailing = (peer_call(self.state, index).shape or ())[1:]
        # each array keeps its rows: the nodes send them in the headers, which is how an
        # array whose rows hold no elements (a zero in its trailing shape) counts them
        mine = {rv.rank_of[c.peer_id]: np.ascontiguousarray(backend.to_host(c.array))
                for c in calls}
        parts = link_of(rv).all_gather(global_op(self.state, deadline), mine,
                                       strategy=self.plan.global_strategy)
        full = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.empty(0)
        self.shape = (sum(p.shape[0] for p in parts), *trailing)
        self.flat = backend.from_host(full, dtype, (full.size,), rv.devices[index])
