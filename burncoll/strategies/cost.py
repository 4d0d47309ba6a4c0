"""The cost model: what each global strategy's schedule moves, exactly, and an alpha-beta time.

For a strategy, an operation, ``N`` participants and an array of ``S`` bytes (the whole array,
cut into the schedule's chunks of ``S / num_chunks`` bytes, as the walk cuts it; default owners
and root 0), :func:`cost` gives, without building the schedule (closed forms, or the heap's
arithmetic for a tree): the total *messages* (steps: one frame each up to the walk's part
size), the total *bytes* they carry, and per round the busiest participant's messages and
bytes (sent plus received: on one host both cost a copy) and the bytes it reduces. The
one-round all-pairs exchange of ``auto`` (:mod:`burncoll.node.exchange`, not a schedule) is
modelled as ``"exchange"``, and its host gather as ``"gather"``.
``tests/strategies/test_cost_model.py`` plays every schedule in the simulator up to
``N = 1,024`` and checks that it moves exactly this.

The time of a round is ``alpha + overhead * messages + beta * bytes + gamma * reduced`` (its
busiest participant's), the time of an operation the sum over its rounds: ``alpha`` the
latency of a round (one message's flight), ``overhead`` the cost of one message at one end,
``beta`` seconds per byte moved, ``gamma`` seconds per byte reduced. :class:`Params` holds
them; ``benchmarks/cost_model.py`` measures them (docs/scale.md). Pure and stdlib-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from burncoll.strategies.base import Strategy
from burncoll.strategies.centralized import Centralized
from burncoll.strategies.doubling import Doubling, core
from burncoll.strategies.ring import Ring
from burncoll.strategies.tree import Tree

__all__ = ["EXCHANGE", "GATHER", "OPERATIONS", "Cost", "Params", "RoundCost", "cost"]

#: The operations a strategy schedules (reduce and broadcast from root 0; reduce-scatter and
#: all-gather with one chunk per participant, chunk ``i`` owned by ``i``).
OPERATIONS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather")
#: The one-round all-pairs exchange (all-reduce only).
EXCHANGE = "exchange"
#: The host gather (all-reduce only, ``levels.HostGather``): every other node's message to
#: node 0, which reduces them; then node 0's result, posted once in its shared memory and
#: read by every other node (the busiest node of that round moves one message).
GATHER = "gather"


@dataclass(frozen=True, slots=True)
class Params:
    """The model's constants, in seconds (see the module docstring)."""

    alpha: float
    overhead: float
    beta: float
    gamma: float


@dataclass(frozen=True, slots=True)
class RoundCost:
    """One round's busiest participant: the messages and bytes it sends plus receives, and
    the bytes it reduces (each the most over participants, maybe not the same one)."""

    messages: int
    bytes: Fraction
    reduced: Fraction = Fraction(0)

    def time(self, p: Params) -> float:
        return (p.alpha + p.overhead * self.messages + p.beta * float(self.bytes)
                + p.gamma * float(self.reduced))


@dataclass(frozen=True, slots=True)
class Cost:
    """An operation's rounds (in order), and its total messages, bytes and bytes reduced."""

    rounds: tuple[RoundCost, ...]
    messages: int
    bytes: Fraction
    reduced: Fraction = Fraction(0)

    def time(self, p: Params, cores: int | None = None) -> float:
        """The predicted seconds: the sum of the rounds' times -- or, with the participants
        sharing ``cores`` processors (node processes of one host), at least all of their
        work (both ends of every message and byte, every reduction) spread over them."""
        path = sum(r.time(p) for r in self.rounds)
        if cores is None:
            return path
        work = (2 * p.overhead * self.messages + 2 * p.beta * float(self.bytes)
                + p.gamma * float(self.reduced))
        return max(path, work / cores)

    def then(self, other: Cost) -> Cost:
        return Cost(self.rounds + other.rounds, self.messages + other.messages,
                    self.bytes + other.bytes, self.reduced + other.reduced)


_NONE = Cost((), 0, Fraction(0))


def _uniform(count: int, messages: int, chunk: Fraction, per_round: RoundCost) -> Cost:
    """``count`` rounds like ``per_round``, of ``messages`` steps of ``chunk`` bytes each
    (all REDUCE if ``per_round`` reduces, else all COPY)."""
    moved = count * messages * chunk
    return Cost((per_round,) * count, count * messages, moved, moved if per_round.reduced else
                Fraction(0))


def _one(messages: int, chunk: Fraction, busiest: int, reduces: bool) -> Cost:
    """One round of ``messages`` steps of ``chunk`` bytes whose busiest participant sends or
    receives ``busiest`` of them (and reduces what it receives when ``reduces``)."""
    moved = busiest * chunk
    return _uniform(1, messages, chunk, RoundCost(busiest, moved, moved if reduces else
                                                  Fraction(0)))


def _centralized(op: str, n: int, s: Fraction) -> Cost:
    c = s / n
    if op == "reduce_scatter":
        return _one(n * (n - 1), c, n * (n - 1), True).then(_one(n - 1, c, n - 1, False))
    if op == "all_gather":
        return _one(n - 1, c, n - 1, False).then(_one((n - 1) ** 2, c, (n - 1) ** 2, False))
    up, down = _one(n - 1, s, n - 1, True), _one(n - 1, s, n - 1, False)
    return {"reduce": up, "broadcast": down, "all_reduce": up.then(down)}[op]


def _ring(op: str, n: int, s: Fraction) -> Cost:
    c = s / n
    reducing = _uniform(n - 1, n, c, RoundCost(2, 2 * c, c))
    copying = _uniform(n - 1, n, c, RoundCost(2, 2 * c))
    if op == "reduce":
        return reducing.then(_one(n - 1, c, n - 1, False))
    if op == "broadcast":
        busy = 2 if n > 2 else 1  # the root only sends; past it, a node receives and sends
        return _one(n - 1, c, n - 1, False).then(
            _uniform(n - 1, n - 1, c, RoundCost(busy, busy * c)))
    return {"reduce_scatter": reducing, "all_gather": copying,
            "all_reduce": reducing.then(copying)}[op]


def _heap(arity: int, n: int) -> tuple[list[list[int]], list[int]]:
    """The tree's levels (virtual ranks by depth) and every node's subtree size."""
    levels, first = [[0]], 1
    while first < n:
        width = len(levels[-1]) * arity
        levels.append(list(range(first, min(first + width, n))))
        first += width
    sizes = [1] * n
    for v in range(n - 1, 0, -1):
        sizes[(v - 1) // arity] += sizes[v]
    return levels, sizes


def _tree(arity: int, op: str, n: int, s: Fraction) -> Cost:
    levels, sizes = _heap(arity, n)
    if op == "all_gather":
        return _tree_all_gather(arity, n, s, levels, sizes)
    fan = [min(arity, len(level)) for level in levels[1:]]  # the fullest parent's children
    chunks = n if op == "reduce_scatter" else 1
    c = s / chunks
    up = Cost(tuple(RoundCost(f * chunks, f * s, f * s) for f in reversed(fan)),
              (n - 1) * chunks, (n - 1) * s, (n - 1) * s)
    down = Cost(tuple(RoundCost(f, f * s) for f in fan), n - 1, (n - 1) * s)
    if op == "reduce_scatter":
        return up.then(_one(n - 1, c, n - 1, False))
    return {"reduce": up, "broadcast": down, "all_reduce": up.then(down)}[op]


def _tree_all_gather(arity: int, n: int, s: Fraction, levels: list[list[int]],
                     sizes: list[int]) -> Cost:
    """Gather up (a node forwards its subtree's chunks), then spread down (a parent sends a
    child every chunk outside the child's subtree); a parent is each round's busiest."""
    c = s / n
    gather, spread = [], []
    for parents in levels[:-1]:
        kids = [range(arity * p + 1, min(arity * p + arity + 1, n)) for p in parents]
        gather.append(max(sum(sizes[v] for v in k) for k in kids))
        spread.append(max(sum(n - sizes[v] for v in k) for k in kids))
    return Cost(tuple(RoundCost(m, m * c) for m in [*reversed(gather), *spread]),
                n * (n - 1), n * (n - 1) * c)


def _doubling(op: str, n: int, s: Fraction) -> Cost:
    if op != "all_reduce":
        return _tree(2, op, n, s)
    p = core(n)
    extra, doublings = n - p, p.bit_length() - 1
    rounds = _uniform(doublings, p, s, RoundCost(2, 2 * s, s))
    if not extra:
        return rounds
    return _one(extra, s, 1, True).then(rounds).then(_one(extra, s, 1, False))


def cost(strategy: Strategy | str, operation: str, world: int, size: int) -> Cost:
    """What ``strategy`` (or :data:`EXCHANGE`, :data:`GATHER`) moves for ``operation`` (one of
    :data:`OPERATIONS`) among ``world`` participants, for an array of ``size`` bytes."""
    if operation not in OPERATIONS or (strategy in (EXCHANGE, GATHER)
                                       and operation != "all_reduce"):
        raise ValueError(f"no cost for {operation!r} by {strategy!r}")
    if world < 1 or size < 0:
        raise ValueError(f"world must be >= 1 and size >= 0, got {world} and {size}")
    n, s = world, Fraction(size)
    if n == 1:
        return _NONE
    if strategy == EXCHANGE:
        busiest = RoundCost(2 * (n - 1), 2 * (n - 1) * s, (n - 1) * s)  # N - 1 out, N - 1 in
        return Cost((busiest,), n * (n - 1), n * (n - 1) * s, n * (n - 1) * s)
    if strategy == GATHER:
        return _one(n - 1, s, n - 1, True).then(_one(n - 1, s, 1, False))
    if isinstance(strategy, Centralized):
        return _centralized(operation, n, s)
    if isinstance(strategy, Ring):
        return _ring(operation, n, s)
    if isinstance(strategy, Tree):
        return _tree(strategy.arity, operation, n, s)
    if isinstance(strategy, Doubling):
        return _doubling(operation, n, s)
    raise ValueError(f"no cost model for {strategy!r}: resolve 'auto' first")
