"""The cost model against the simulator: every strategy's schedule, played step by step,
moves exactly the messages, bytes and rounds (and per round the busiest participant's
messages, bytes and bytes reduced) that :func:`burncoll.strategies.cost.cost` predicts without
building it -- up to 1,024 participants, powers of two or not."""

from __future__ import annotations

from fractions import Fraction

import pytest

from burncoll.strategies import Centralized, Doubling, Ring, Schedule, Strategy, Tree
from burncoll.strategies.base import default_owners
from burncoll.strategies.cost import EXCHANGE, GATHER, OPERATIONS, Params, cost

from .simulator import tally

STRATEGIES: list[Strategy] = [Centralized(), Tree(1), Tree(2), Tree(3), Tree(8), Ring(),
                              Doubling()]
#: Every world to 40, and around powers of two beyond.
WORLDS = [*range(1, 41), 63, 64, 65, 100, 127, 129]
SIZE = 3 * 5 * 7 << 10  # bytes: chunks of a non-integral size too (exact Fractions)


def schedule(strategy: Strategy, operation: str, world: int) -> Schedule:
    """The schedule, built without the strategies' cache (large worlds are built once)."""
    make = getattr(type(strategy), operation).__wrapped__
    if operation in ("reduce", "broadcast"):
        return make(strategy, world, 0)  # type: ignore[no-any-return]
    if operation in ("reduce_scatter", "all_gather"):
        return make(strategy, world, default_owners(world))  # type: ignore[no-any-return]
    return make(strategy, world)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.spec)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_model_is_exact_over_a_sweep_of_worlds(strategy: Strategy, operation: str) -> None:
    for world in WORLDS:
        assert tally(schedule(strategy, operation, world), SIZE) == cost(
            strategy, operation, world, SIZE), (strategy.spec, operation, world)


#: At 1,024 participants: Doubling's other operations are Tree(2)'s (checked there).
AT_1024 = [(s, op) for s in [Centralized(), Tree(2), Tree(3), Ring()] for op in OPERATIONS]
AT_1024 += [(Doubling(), "all_reduce")]


@pytest.mark.slow  # 1-8 s each: a million steps for the operations of N chunks
@pytest.mark.parametrize(("strategy", "operation"), AT_1024,
                         ids=[f"{s.spec}-{op}" for s, op in AT_1024])
def test_the_model_is_exact_at_1024(strategy: Strategy, operation: str) -> None:
    assert tally(schedule(strategy, operation, 1024), 1 << 20) == cost(
        strategy, operation, 1024, 1 << 20)


def test_doubling_at_1024_and_1000() -> None:
    c = cost(Doubling(), "all_reduce", 1024, 8)
    assert (len(c.rounds), c.messages, c.bytes) == (10, 1024 * 10, 8 * 1024 * 10)
    c = cost(Doubling(), "all_reduce", 1000, 8)  # 488 fold into the core of 512
    assert (len(c.rounds), c.messages) == (9 + 2, 512 * 9 + 2 * 488)


def test_the_exchange() -> None:
    c = cost(EXCHANGE, "all_reduce", 1024, 8)
    assert (len(c.rounds), c.messages, c.bytes) == (1, 1024 * 1023, 8 * 1024 * 1023)
    assert c.rounds[0].messages == 2 * 1023 and c.rounds[0].reduced == 8 * 1023


@pytest.mark.parametrize("n", [2, 3, 16, 64, 1024])
def test_the_gather_moves_what_the_centralized_all_reduce_moves_but_posts_its_result_once(
        n: int) -> None:
    c, central = cost(GATHER, "all_reduce", n, 8), cost(Centralized(), "all_reduce", n, 8)
    assert (c.messages, c.bytes, c.reduced) == (central.messages, central.bytes,
                                                 central.reduced) == (
        2 * (n - 1), 16 * (n - 1), 8 * (n - 1))
    assert c.rounds[0] == central.rounds[0]  # node 0 reads and reduces every other's
    assert (c.rounds[1].messages, c.rounds[1].bytes) == (1, 8)  # posted once, read by each
    assert cost(GATHER, "all_reduce", n, 8).messages < cost(EXCHANGE, "all_reduce", n, 8
                                                            ).messages or n == 2


def test_time_sums_the_rounds() -> None:
    p = Params(alpha=1.0, overhead=0.5, beta=0.25, gamma=0.125)
    c = cost(Ring(), "all_reduce", 4, 8)  # 6 rounds, 1 in + 1 out of 2 bytes, 3 reducing
    assert c.time(p) == 6 * (1.0 + 2 * 0.5 + 4 * 0.25) + 3 * 2 * 0.125
    assert c.bytes == Fraction(2 * 3 * 8)
    assert cost(Ring(), "all_reduce", 1, 8).time(p) == 0
    # 4 participants on 1 core: all of their work, 24 messages and 48 bytes at both ends
    assert c.time(p, cores=1) == 2 * 0.5 * 24 + 2 * 0.25 * 48 + 0.125 * 24


@pytest.mark.parametrize("bad", [("tree:2", "all_reduce", 4, 8), (Ring(), "scan", 4, 8),
                                 (EXCHANGE, "reduce", 4, 8), (GATHER, "broadcast", 4, 8),
                                 (Ring(), "all_reduce", 0, 8),
                                 (Ring(), "all_reduce", 4, -1)])
def test_refuses_what_it_does_not_model(bad: tuple[object, str, int, int]) -> None:
    with pytest.raises(ValueError):
        cost(*bad)  # type: ignore[arg-type]
