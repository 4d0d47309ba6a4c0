"""``GlobalBarrier``: the local peers have arrived; one of them meets the other nodes."""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.backends.base import Array
from burncoll.levels import Exchange
from burncoll.local.plans.phases import global_op, link_of
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy

__all__ = ["GlobalBarrier", "GlobalBarrierRun"]


@dataclass(frozen=True, slots=True)
class GlobalBarrier:
    """``route``: the nodes meet in a one-round exchange, or by that strategy's
    all-reduce schedule."""

    route: Exchange | Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalBarrierRun:
        return GlobalBarrierRun(self, rv, state)


@dataclass(frozen=True, slots=True)
class GlobalBarrierRun:
    plan: GlobalBarrier
    rv: Rendezvous
    state: OpState

    def run(self, index: int, deadline: float) -> Array | None:
        if index == 0:
            link_of(self.rv).barrier(global_op(self.state, deadline),
                                     route=self.plan.route)
        self.rv.sync(self.state, index, deadline, "global barrier")
        return None
