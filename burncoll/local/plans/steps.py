"""Local schedules indexed for the peer threads, and the walk of one peer through one.

Schedules are pure values of (strategy, world, root), so each index is built once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from burncoll.backends.base import Backend
from burncoll.local.buffers import ChunkBuffer
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import ReduceOp
from burncoll.strategies import Action, Schedule, Step, Strategy
from burncoll.strategies.base import default_owners

__all__ = [
    "StepIndex",
    "all_gather_steps",
    "all_reduce_steps",
    "broadcast_steps",
    "reduce_scatter_steps",
    "reduce_steps",
    "walk",
]

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
