"""``GlobalReduce``: a reduce across nodes. The local peers reduce to the node's leader (the
root itself on the root's node), and the leaders reduce across the nodes into the root."""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.backends.base import Array
from burncoll.local.plans.phases import (
    LocalReduce,
    finish_reduce,
    global_op,
    link_of,
    peer_call,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy

__all__ = ["GlobalReduce", "GlobalReduceRun"]


@dataclass(frozen=True, slots=True)
class GlobalReduce:
    """``strategy``: the local reduce's; ``leader``: the local index that talks to other
    nodes; ``root_node``: the node of the root; ``global_strategy``: the global reduce's."""

    strategy: Strategy
    leader: int
    root_node: int
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalReduceRun:
        return GlobalReduceRun(self, rv, state, LocalReduce(rv, state, self.strategy,
                                                            self.leader))


@dataclass(frozen=True, slots=True)
class GlobalReduceRun:
    plan: GlobalReduce
    rv: Rendezvous
    state: OpState
    local_reduce: LocalReduce

    def run(self, index: int, deadline: float) -> Array | None:
        rv, plan = self.rv, self.plan
        call = peer_call(self.state, index)
        self.local_reduce.run(index, deadline, call.reduce_op)
        result: Array | None = None
        if index == plan.leader:
            link = link_of(rv)
            host = self.local_reduce.host()
            link.reduce(global_op(self.state, deadline), host, plan.root_node,
                        strategy=plan.global_strategy)
            if plan.root_node == link.node_index:
                result = rv.backend.from_host(host, call.dtype or "float32", call.shape or (),
                                              rv.devices[index])
                result = finish_reduce(rv, result, call.reduce_op)
        rv.sync(self.state, index, deadline, "global reduce")
        return result
