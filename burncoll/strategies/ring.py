"""Ring: bandwidth-optimal reduce-scatter and all-gather around the ring ``0 -> 1 -> ... -> 0``.

Reference: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2), 2009.

Chunk convention (read this before writing an executor): the ring reduce-scatter ends with
participant ``i`` holding the full reduction of chunk ``i`` (more generally, of the chunks
``i`` owns). In round ``r`` (``0 <= r < N - 1``) participant ``i`` sends chunk
``(i - 1 - r) % N`` to ``(i + 1) % N``, which REDUCEs it; so chunk ``c`` starts at participant
``c + 1``, travels once around the ring and is complete when it reaches ``c``, reduced in the
order ``x[c+1] + x[c+2] + ... + x[c]`` (indices mod N). The ring all-gather then has
participant ``i`` send chunk ``(i - r) % N`` to ``(i + 1) % N`` in round ``r`` (COPY).

With ``S`` bytes split into ``N`` equal chunks, an all-reduce takes ``2 (N - 1)`` rounds and
every participant sends (and receives) exactly ``2 (N - 1) / N * S`` bytes, the lower bound.
Within a round participant ``i`` reads chunk ``k`` and writes chunk ``k - 1``, so no
(participant, chunk) is read and written in the same round.
"""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.strategies._checks import check_owners, check_root, check_world, drop_empty
from burncoll.strategies.base import Strategy, cached_schedules
from burncoll.strategies.schedule import Action, Round, Schedule, Step

__all__ = ["Ring"]

def _groups(world: int, owners: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``groups[p]``: the chunks owned by participant ``p``, ascending."""
    groups: list[list[int]] = [[] for _ in range(world)]
    for c, o in enumerate(owners):
        groups[o].append(c)
    return tuple(tuple(g) for g in groups)


def _reduce_scatter_rounds(world: int, groups: tuple[tuple[int, ...], ...]) -> list[Round]:
    """N - 1 rounds after which participant ``p`` holds ``groups[p]`` fully reduced."""
    return [
        tuple(Step(i, (i + 1) % world, c, Action.REDUCE) for i in range(world)
              for c in groups[(i - 1 - r) % world])
        for r in range(world - 1)
    ]


def _all_gather_rounds(world: int, groups: tuple[tuple[int, ...], ...],
                       skip_dst: int | None = None) -> list[Round]:
    """N - 1 rounds after which everyone holds every group, if ``p`` starts with ``groups[p]``.
    Steps into ``skip_dst`` (a participant that already holds everything) are left out."""
    return [
        tuple(Step(i, (i + 1) % world, c, Action.COPY) for i in range(world)
              if (i + 1) % world != skip_dst for c in groups[(i - r) % world])
        for r in range(world - 1)
    ]


@cached_schedules
@dataclass(frozen=True)
class Ring(Strategy):
    """Ring reduce-scatter and all-gather (Patarasuk & Yuan 2009); see the module docstring
    for the chunk convention (participant ``i`` ends the reduce-scatter with chunk ``i``).

    * ``all_reduce(world)``: ``N`` chunks; ring reduce-scatter (N - 1 rounds of REDUCE), then
      ring all-gather (N - 1 rounds of COPY). Each participant sends ``2 (N-1)/N * S`` bytes.
    * ``reduce_scatter(world, owners)``: ``len(owners)`` chunks; the ring reduce-scatter moves
      whole owner groups (the chunks of one owner) in place of single chunks, so ``owners[c]``
      ends with chunk ``c`` fully reduced (N - 1 rounds).
    * ``all_gather(world, owners)``: ring all-gather of owner groups (N - 1 rounds of COPY).
    * ``reduce(world, root)``: ``N`` chunks; ring reduce-scatter, then one round in which every
      participant ``i != root`` copies chunk ``i`` to ``root`` (N rounds).
    * ``broadcast(world, root)``: ``N`` chunks; one round in which ``root`` copies chunk ``i``
      to participant ``i``, then a ring all-gather that sends nothing to ``root`` (N rounds).

    Empty rounds are dropped (``world == 1`` gives zero rounds, with ``num_chunks`` still
    ``world`` or ``len(owners)``). Schedules are cached.
    """

    @property
    def spec(self) -> str:
        return "ring"

    def reduce(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        rounds = _reduce_scatter_rounds(world, _groups(world, tuple(range(world))))
        rounds.append(tuple(Step(i, root, i, Action.COPY) for i in range(world) if i != root))
        return Schedule(world, world, drop_empty(rounds))

    def broadcast(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        rounds: list[Round] = [tuple(Step(root, i, i, Action.COPY) for i in range(world)
                                     if i != root)]
        rounds += _all_gather_rounds(world, _groups(world, tuple(range(world))), skip_dst=root)
        return Schedule(world, world, drop_empty(rounds))

    def all_reduce(self, world: int) -> Schedule:
        check_world(world)
        groups = _groups(world, tuple(range(world)))
        rounds = _reduce_scatter_rounds(world, groups) + _all_gather_rounds(world, groups)
        return Schedule(world, world, drop_empty(rounds))

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        rounds = _reduce_scatter_rounds(world, _groups(world, owners))
        return Schedule(world, len(owners), drop_empty(rounds))

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        rounds = _all_gather_rounds(world, _groups(world, owners))
        return Schedule(world, len(owners), drop_empty(rounds))
