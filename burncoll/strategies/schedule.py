"""Schedules: what a strategy produces and what the executors walk.

A collective runs among ``world`` participants ``0 .. world-1`` (local peers of one node, or
nodes), each holding a buffer cut into ``num_chunks`` chunks (the executor decides where each
starts and stops). A :class:`Schedule` is a sequence of rounds, a round a tuple of
:class:`Step` s, a step moving chunk ``chunk`` from ``src`` to ``dst`` and combining it
(:attr:`Action.REDUCE`: ``dst[c] = dst[c] (op) src[c]``) or replacing it (:attr:`Action.COPY`).
Every step of a round reads what its source held *at the start of the round*: a valid schedule
never reads and writes one (participant, chunk) in the same round, so executors may interleave
a round's steps freely; steps with the same destination run in the order listed (a fixed,
reproducible reduction order). The one exception is an *exchange* schedule (a strategy whose
``exchanges`` is true: :class:`~burncoll.strategies.doubling.Doubling`), where a participant
may send a chunk and REDUCE into it in the same round: only an executor that performs a
participant's sends of a round before its receives (the node walk) may run it. Executors may
synchronise between rounds (threads) or not at all (the network executor matches messages by
round).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "Round", "Schedule", "Step"]


class Action(enum.IntEnum):
    """What the destination does with the chunk it receives."""

    REDUCE = 1
    COPY = 2


@dataclass(frozen=True, slots=True)
class Step:
    """Move chunk ``chunk`` from participant ``src`` to participant ``dst``."""

    src: int
    dst: int
    chunk: int
    action: Action


Round = tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Rounds of steps among ``world`` participants over ``num_chunks`` chunks."""

    world: int
    num_chunks: int
    rounds: tuple[Round, ...]

    def steps_into(self, participant: int, round_index: int) -> tuple[Step, ...]:
        """The steps of round ``round_index`` whose destination is ``participant``."""
        return tuple(s for s in self.rounds[round_index] if s.dst == participant)

    def then(self, other: Schedule) -> Schedule:
        """This schedule followed by ``other`` (same world and chunks)."""
        if (other.world, other.num_chunks) != (self.world, self.num_chunks):
            raise ValueError("can only chain schedules of the same world and chunk count")
        return Schedule(self.world, self.num_chunks, self.rounds + other.rounds)
