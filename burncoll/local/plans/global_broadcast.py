"""``GlobalBroadcast``: a broadcast across nodes. The node's leader (the root itself on the
root's node) takes part in the global broadcast, then broadcasts the array to its local peers.
Receivers learn the dtype and shape from the root's frames."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from burncoll.backends.base import Array
from burncoll.dtypes import dtype_name
from burncoll.levels import GlobalOp
from burncoll.local.plans import steps as steps_of
from burncoll.local.plans.phases import LocalBroadcast, global_op, link_of, writable_host
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy

__all__ = ["GlobalBroadcast", "GlobalBroadcastRun"]


@dataclass(frozen=True, slots=True)
class GlobalBroadcast:
    """``strategy``: the local broadcast's; ``leader``: the local index that talks to other
    nodes; ``root_node``: the node of the root; ``global_strategy``: the global broadcast's."""

    strategy: Strategy
    leader: int
    root_node: int
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalBroadcastRun:
        steps = steps_of.broadcast_steps(self.strategy, rv.size, self.leader)
        return GlobalBroadcastRun(self, rv, state, LocalBroadcast(rv, state, steps))


@dataclass(slots=True)
class GlobalBroadcastRun:
    plan: GlobalBroadcast
    rv: Rendezvous
    state: OpState
    local_broadcast: LocalBroadcast
    #: What the leader received (or sent): flat on its device, with its dtype and shape.
    flat: Array | None = field(default=None)
    dtype: str = "float32"
    shape: tuple[int, ...] = ()

    def run(self, index: int, deadline: float) -> Array:
        rv, leader = self.rv, self.plan.leader
        if index == leader:
            self._across_nodes(index, global_op(self.state, deadline))
        rv.sync(self.state, index, deadline, "global broadcast")
        out = self.local_broadcast.run(index, deadline, leader, self.flat, self.dtype)
        return rv.backend.reshape(out, self.shape)

    def _across_nodes(self, index: int, gop: GlobalOp) -> None:
        rv, link = self.rv, link_of(self.rv)
        mine = self.state.calls[index]
        send = None
        if self.plan.root_node == link.node_index and mine is not None:
            send = writable_host(rv, rv.backend.flatten(mine.array))
            # the root's shape travels in the frames; receivers adopt it
            gop = GlobalOp(gop.seq, gop.kind, gop.reduce_op, mine.dtype, mine.shape or (),
                           gop.root, gop.deadline, gop.started)
        host = link.broadcast(gop, send, self.plan.root_node,
                              strategy=self.plan.global_strategy)
        self.dtype = dtype_name(host.dtype)
        self.shape = tuple(host.shape)
        self.flat = rv.backend.from_host(np.ascontiguousarray(host).reshape(-1), self.dtype,
                                         (host.size,), rv.devices[index])
