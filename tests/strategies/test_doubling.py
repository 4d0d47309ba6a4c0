"""Doubling: the recursive-doubling all-reduce, played in the simulator for every world."""

from __future__ import annotations

import pytest

from burncoll.config import CollectiveConfig
from burncoll.errors import ConfigError
from burncoll.strategies import Doubling, Tree, parse_strategy
from burncoll.strategies._checks import validate_schedule
from burncoll.strategies.doubling import core

from .simulator import Expr, ScheduleViolation, full, own_data, play


def canonical(expr: Expr) -> Expr:
    """``expr`` with the operands of every reduction in a fixed order: two participants that
    computed ``a (op) b`` and ``b (op) a`` hold the same canonical expression."""
    if isinstance(expr, int):
        return expr
    a, b = sorted((canonical(expr[0]), canonical(expr[1])), key=repr)
    return (a, b)


@pytest.mark.parametrize("world", range(1, 70))
def test_every_node_ends_with_every_contribution_once(world: int) -> None:
    sched = Doubling().all_reduce(world)
    validate_schedule(sched, exchanges=True)
    p = core(world)
    assert len(sched.rounds) == p.bit_length() - 1 + (2 if world > p else 0)
    state = play(sched, own_data(world, 1), exchanges=True).state
    values = [state[n][0] for n in range(world)]
    assert all(v is not None and v.counts == full(world) for v in values)
    # the same reduction everywhere, up to the order of the operands of each (op)
    assert len({canonical(v.expr) for v in values if v is not None}) == 1


def test_it_is_an_exchange_schedule() -> None:
    sched = Doubling().all_reduce(4)
    with pytest.raises(ValueError, match="read and written"):
        validate_schedule(sched)
    with pytest.raises(ScheduleViolation, match="read and written"):
        play(sched, own_data(4, 1))
    assert Doubling().exchanges and not Tree(2).exchanges


def test_other_operations_are_the_binary_trees() -> None:
    d, t = Doubling(), Tree(2)
    assert d.reduce(9, 4) == t.reduce(9, 4) and d.broadcast(9, 4) == t.broadcast(9, 4)
    assert d.reduce_scatter(5, (0, 4, 4)) == t.reduce_scatter(5, (0, 4, 4))
    assert d.all_gather(5, (1, 2)) == t.all_gather(5, (1, 2))


def test_its_name() -> None:
    assert parse_strategy(" Doubling ") == Doubling() and Doubling().spec == "doubling"
    assert CollectiveConfig(global_all_reduce_strategy="doubling").strategy(
        "global_all_reduce_strategy") == Doubling()


@pytest.mark.parametrize("field", ["local_all_reduce_strategy", "local_reduce_strategy",
                                   "local_broadcast_strategy"])
def test_it_is_refused_on_one_node(field: str) -> None:
    for value in ("doubling", Doubling()):
        with pytest.raises(ConfigError, match=f"{field}.*between nodes only"):
            CollectiveConfig(**{field: value})  # type: ignore[arg-type]
