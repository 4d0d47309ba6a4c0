"""Centralized: everything goes through one participant.

Reduce and broadcast take one round each; the root receives (or sends) ``N - 1`` whole buffers,
so its link carries ``(N - 1) * S`` bytes. Best for small worlds and small arrays (e.g. the
threads of one node), where latency, not bandwidth, dominates.
"""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.strategies._checks import check_owners, check_root, check_world, drop_empty
from burncoll.strategies.base import Strategy, cached_schedules
from burncoll.strategies.schedule import Action, Round, Schedule, Step

__all__ = ["Centralized"]


def _reduce_round(world: int, root: int, num_chunks: int) -> Round:
    """Every non-root sends each chunk to ``root`` (REDUCE), in rank order, then chunk order."""
    return tuple(Step(src, root, c, Action.REDUCE) for src in range(world) if src != root
                 for c in range(num_chunks))


def _broadcast_round(world: int, root: int, num_chunks: int) -> Round:
    """``root`` copies each chunk to every other participant, in rank order."""
    return tuple(Step(root, dst, c, Action.COPY) for dst in range(world) if dst != root
                 for c in range(num_chunks))


@cached_schedules
@dataclass(frozen=True)
class Centralized(Strategy):
    """Every operation goes through one participant (the root, or participant 0).

    * ``reduce(world, root)``: 1 chunk; one round in which every non-root sends to ``root``
      (REDUCE), in rank order -- so the root reduces ``x_root + x_0 + x_1 + ...`` skipping itself.
    * ``broadcast(world, root)``: 1 chunk; one round of COPY from ``root`` to everyone.
    * ``all_reduce(world)``: 1 chunk; reduce to 0, then broadcast from 0 (2 rounds if N > 1).
    * ``reduce_scatter(world, owners)``: reduce every chunk to 0, then one round of COPY of
      chunk ``c`` from 0 to ``owners[c]`` (skipped where the owner is 0).
    * ``all_gather(world, owners)``: one round of COPY of each chunk from its owner to 0
      (skipped where the owner is 0), then one round of COPY of every chunk from 0 to every
      participant that does not own it.

    Empty rounds are dropped (``world == 1`` gives zero rounds). Schedules are cached.
    """

    @property
    def spec(self) -> str:
        return "centralized"

    def reduce(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        return Schedule(world, 1, drop_empty([_reduce_round(world, root, 1)]))

    def broadcast(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        return Schedule(world, 1, drop_empty([_broadcast_round(world, root, 1)]))

    def all_reduce(self, world: int) -> Schedule:
        check_world(world)
        return self.reduce(world, 0).then(self.broadcast(world, 0))

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        n = len(owners)
        scatter: Round = tuple(Step(0, o, c, Action.COPY) for c, o in enumerate(owners) if o != 0)
        return Schedule(world, n, drop_empty([_reduce_round(world, 0, n), scatter]))

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        n = len(owners)
        gather: Round = tuple(Step(o, 0, c, Action.COPY) for c, o in enumerate(owners) if o != 0)
        spread: Round = tuple(Step(0, dst, c, Action.COPY) for dst in range(1, world)
                              for c in range(n) if owners[c] != dst)
        return Schedule(world, n, drop_empty([gather, spread]))
