"""``LocalBarrier``: a barrier on one node is the arrival itself; there is nothing to run."""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.backends.base import Array
from burncoll.local.rendezvous import OpState, Rendezvous

__all__ = ["Arrived", "LocalBarrier"]


@dataclass(frozen=True, slots=True)
class LocalBarrier:
    """Every local peer has arrived: that is the barrier."""

    def prepare(self, rv: Rendezvous, state: OpState) -> Arrived:
        return Arrived()


@dataclass(frozen=True, slots=True)
class Arrived:
    def run(self, index: int, deadline: float) -> Array | None:
        return None
