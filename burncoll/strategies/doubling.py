"""Doubling: the recursive-doubling all-reduce, ``log2`` rounds for any number of nodes.

Reference: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective communication
operations in MPICH", Int. J. High Perform. Comput. Appl. 19(1), 2005 (section 4.4).

With ``p`` the largest power of two ``<= N`` and ``r = N - p``: a *fold* round in which node
``p + i`` sends its array to node ``i`` (REDUCE, ``i < r``); ``log2 p`` rounds in which node
``i < p`` and its partner ``i XOR 2**k`` send each other what they hold and each REDUCEs the
other's into its own; an *unfold* round in which node ``i`` copies the result to ``p + i``.
One chunk (the whole array): ``log2 p + 2 [r > 0]`` rounds, one message out and one in per
node and round -- for small arrays among many nodes, where the all-pairs exchange costs
``N - 1`` messages a node and the tree twice the rounds.

It is an *exchange* schedule (:attr:`Strategy.exchanges`): in a doubling round a node sends
its chunk and reduces its partner's into that same chunk. The node walk runs each round's sends
before its receives (and a transfer hands its bytes over before it returns), so each side sends
what the round found; the threads of one node apply steps in any order and never get it (the
config refuses it for a local strategy). The two partners compute ``a (op) b`` and
``b (op) a``: identical bits for commutative operations (IEEE sums, products, minima and
maxima of numbers; NaN payloads aside), not the "computed once, then copied" of the others.
Reduce, broadcast, reduce-scatter and all-gather are :class:`~burncoll.strategies.Tree`
``(2)``'s. Pure and stdlib-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.strategies._checks import check_world
from burncoll.strategies.base import Strategy, cached_schedules
from burncoll.strategies.schedule import Action, Round, Schedule, Step
from burncoll.strategies.tree import Tree

__all__ = ["Doubling", "core"]

_TREE = Tree(2)


def core(world: int) -> int:
    """The largest power of two ``<= world``: the nodes that double (the others fold in)."""
    return 1 << (world.bit_length() - 1)


@cached_schedules
@dataclass(frozen=True)
class Doubling(Strategy):
    """Recursive doubling all-reduce (any ``N``: the extra nodes fold into the power-of-two
    core and unfold after); the other operations as ``Tree(2)``. See the module docstring."""

    @property
    def exchanges(self) -> bool:
        return True

    @property
    def spec(self) -> str:
        return "doubling"

    def reduce(self, world: int, root: int) -> Schedule:
        return _TREE.reduce(world, root)

    def broadcast(self, world: int, root: int) -> Schedule:
        return _TREE.broadcast(world, root)

    def all_reduce(self, world: int) -> Schedule:
        check_world(world)
        p = core(world)
        extra = range(world - p)
        rounds: list[Round] = [tuple(Step(p + i, i, 0, Action.REDUCE) for i in extra)]
        distance = 1
        while distance < p:
            rounds.append(tuple(Step(i ^ distance, i, 0, Action.REDUCE) for i in range(p)))
            distance <<= 1
        rounds.append(tuple(Step(i, p + i, 0, Action.COPY) for i in extra))
        return Schedule(world, 1, tuple(r for r in rounds if r))

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        return _TREE.reduce_scatter(world, owners)

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        return _TREE.all_gather(world, owners)
