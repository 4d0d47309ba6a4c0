"""``ReduceGlobalBroadcast``: an all-reduce across nodes that do not shard it.

The local peers reduce to the node's leader, the leaders all-reduce across the nodes, and each
leader broadcasts the result back to its local peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from burncoll.backends.base import Array
from burncoll.levels import Route
from burncoll.local.plans import steps as steps_of
from burncoll.local.plans.phases import (
    LocalBroadcast,
    LocalReduce,
    finish_reduce,
    global_op,
    link_of,
    peer_call,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy

__all__ = ["ReduceGlobalBroadcast", "ReduceGlobalBroadcastRun"]


@dataclass(frozen=True, slots=True)
class ReduceGlobalBroadcast:
    """``reduce``, ``broadcast``: the local phases' strategies; ``leader``: the local index
    that talks to other nodes; ``route``: the global all-reduce's, the one-round
    exchange or a schedule."""

    reduce: Strategy
    broadcast: Strategy
    leader: int
    route: Route

    def prepare(self, rv: Rendezvous, state: OpState) -> ReduceGlobalBroadcastRun:
        return ReduceGlobalBroadcastRun(
            self, rv, state, LocalReduce(rv, state, self.reduce, self.leader),
            LocalBroadcast(rv, state, steps_of.broadcast_steps(self.broadcast, rv.size,
                                                               self.leader)))


@dataclass(slots=True)
class ReduceGlobalBroadcastRun:
    plan: ReduceGlobalBroadcast
    rv: Rendezvous
    state: OpState
    local_reduce: LocalReduce
    local_broadcast: LocalBroadcast
    #: The global result, on the leader's device (set by the leader).
    total: Array | None = field(default=None)

    def run(self, index: int, deadline: float) -> Array:
        rv, leader = self.rv, self.plan.leader
        call = peer_call(self.state, index)
        dtype = call.dtype or "float32"
        self.local_reduce.run(index, deadline, call.reduce_op)
        if index == leader:
            host = self.local_reduce.host()
            link_of(rv).all_reduce(global_op(self.state, deadline), host,
                                   route=self.plan.route)
            self.total = rv.backend.from_host(host, dtype, (host.size,), rv.devices[index])
        rv.sync(self.state, index, deadline, "global all_reduce")
        out = self.local_broadcast.run(index, deadline, leader, self.total, dtype, owned=True)
        return finish_reduce(rv, rv.backend.reshape(out, call.shape or ()), call.reduce_op)
