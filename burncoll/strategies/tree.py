"""Tree(arity): reduce up and broadcast down a b-ary heap rooted at the root.

Layout: the implicit b-ary heap of heapsort / binary heaps generalised to arity b (Knuth, TAOCP
vol. 3, 5.2.3; Williams 1964), laid out on *virtual* ranks relative to the root::

    v = (rank - root) % world          rank = (v + root) % world
    parent(v)   = (v - 1) // b         (v >= 1)
    children(v) = b*v + 1 .. b*v + b   (those < world)

Level ``d`` holds the virtual ranks at distance ``d`` from the root. For ``b >= 2`` the depth is
the heap depth, the least ``d`` with ``(b**(d+1) - 1) / (b - 1) >= N``, which is at most
``ceil(log_b N)``; for ``b == 1`` the tree is a chain of depth ``N - 1``. A reduce or broadcast
takes one round per level, and each node sends or receives at most ``b`` messages per round.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from burncoll.strategies._checks import check_owners, check_root, check_world, drop_empty
from burncoll.strategies.base import Strategy, cached_schedules
from burncoll.strategies.schedule import Action, Round, Schedule, Step

__all__ = ["Tree"]

_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _levels(arity: int, world: int) -> tuple[tuple[int, ...], ...]:
    """Virtual ranks by depth: ``levels[d]`` are the nodes at distance ``d`` from the root."""
    levels: list[tuple[int, ...]] = [(0,)]
    while True:
        nxt = tuple(
            c for v in levels[-1] for c in range(arity * v + 1, arity * v + arity + 1) if c < world
        )
        if not nxt:
            return tuple(levels)
        levels.append(nxt)


def _parent(arity: int, v: int) -> int:
    return (v - 1) // arity


def _up_rounds(arity: int, world: int, root: int, num_chunks: int) -> list[Round]:
    """Deepest level first: every node of the level sends each chunk to its parent (REDUCE). Steps
    are listed in virtual-rank order, so a parent reduces its children in heap order."""
    return [tuple(Step((v + root) % world, (_parent(arity, v) + root) % world, c, Action.REDUCE)
                  for v in level for c in range(num_chunks))
            for level in reversed(_levels(arity, world)[1:])]


def _down_rounds(arity: int, world: int, root: int, num_chunks: int) -> list[Round]:
    """Level 1 first: every node of the level receives each chunk from its parent (COPY)."""
    return [tuple(Step((_parent(arity, v) + root) % world, (v + root) % world, c, Action.COPY)
                  for v in level for c in range(num_chunks))
            for level in _levels(arity, world)[1:]]


@cached_schedules
@dataclass(frozen=True)
class Tree(Strategy):
    """Reduce up and broadcast down a b-ary heap (``b = arity``) rooted at the root.

    * ``reduce(world, root)``: 1 chunk; one round per level, deepest first; every node of the
      level sends to its parent (REDUCE). Rounds = tree depth.
    * ``broadcast(world, root)``: 1 chunk; one round per level, level 1 first (COPY).
    * ``all_reduce(world)``: 1 chunk; reduce to 0 then broadcast from 0 (2 * depth rounds).
    * ``reduce_scatter(world, owners)``: reduce every chunk to 0 up the tree, then one round of
      COPY of chunk ``c`` from 0 to ``owners[c]`` (skipped where the owner is 0):
      depth + 1 rounds.
    * ``all_gather(world, owners)``: gather up the tree, deepest level first, each node
      forwarding every chunk owned in its subtree to its parent; then spread down, level 1
      first, each parent sending a child every chunk not owned in the child's subtree:
      2 * depth rounds. Nothing is ever sent to a node that already holds it.

    Empty rounds are dropped (``world == 1`` gives zero rounds). Schedules are cached.
    ``arity`` must be ``>= 1`` (:class:`ValueError` otherwise); ``Tree(1)`` is a chain.
    """

    #: The number of children of each node of the tree (``"tree:3"`` is ``Tree(3)``).
    arity: int

    def __post_init__(self) -> None:
        if isinstance(self.arity, bool) or not isinstance(self.arity, int) or self.arity < 1:
            raise ValueError(f"tree arity must be an integer >= 1, got {self.arity!r}")

    @property
    def spec(self) -> str:
        return f"tree:{self.arity}"

    def reduce(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        return Schedule(world, 1, drop_empty(_up_rounds(self.arity, world, root, 1)))

    def broadcast(self, world: int, root: int) -> Schedule:
        check_root(world, root)
        return Schedule(world, 1, drop_empty(_down_rounds(self.arity, world, root, 1)))

    def all_reduce(self, world: int) -> Schedule:
        check_world(world)
        return self.reduce(world, 0).then(self.broadcast(world, 0))

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        n = len(owners)
        rounds = _up_rounds(self.arity, world, 0, n)
        rounds.append(tuple(Step(0, o, c, Action.COPY) for c, o in enumerate(owners) if o != 0))
        return Schedule(world, n, drop_empty(rounds))

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        owners = check_owners(world, owners)
        n, arity = len(owners), self.arity
        levels = _levels(arity, world)
        # held[v]: the chunks owned inside the subtree of v (root 0, so virtual rank == rank).
        held: list[set[int]] = [set() for _ in range(world)]
        for c, o in enumerate(owners):
            held[o].add(c)
        for v in range(world - 1, 0, -1):  # children have larger ranks than their parent
            held[_parent(arity, v)] |= held[v]
        # gather: forward the subtree's chunks to the parent; spread: send each node what its
        # subtree did not own
        gather = [tuple(Step(v, _parent(arity, v), c, Action.COPY) for v in level
                        for c in sorted(held[v])) for level in reversed(levels[1:])]
        spread = [tuple(Step(_parent(arity, v), v, c, Action.COPY) for v in level
                        for c in range(n) if c not in held[v]) for level in levels[1:]]
        return Schedule(world, n, drop_empty(gather + spread))
