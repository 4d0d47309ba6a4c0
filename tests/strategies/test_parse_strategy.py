"""parse_strategy: config spellings to strategies."""

from __future__ import annotations

import pytest

import burncoll
from burncoll.errors import ConfigError
from burncoll.strategies import ByHost, Centralized, Ring, Strategy, Tree, parse_strategy

GOOD: list[tuple[object, Strategy]] = [
    ("centralized", Centralized()),
    ("  Centralized\n", Centralized()),
    ("CENTRALIZED", Centralized()),
    ("ring", Ring()),
    ("\tRing ", Ring()),
    ("tree", Tree(2)),
    ("Tree", Tree(2)),
    ("tree:1", Tree(1)),
    ("tree:3", Tree(3)),
    ("TREE:16", Tree(16)),
    (" tree : 8 ", Tree(8)),
    ("tree:007", Tree(7)),
]


@pytest.mark.parametrize(("spelling", "expected"), GOOD)
def test_good_spellings(spelling: str, expected: Strategy) -> None:
    got = parse_strategy(spelling)
    assert got == expected
    assert parse_strategy(got.spec) == got  # spec round-trips


@pytest.mark.parametrize("strategy", [Centralized(), Tree(5), Ring()])
def test_instances_pass_through(strategy: Strategy) -> None:
    assert parse_strategy(strategy) is strategy


BAD = ["", " ", "star", "centralised", "tree:", "tree:x", "tree:2.5", "tree:1:2", "tree2",
       "tree:+3", "tree:²", "ring:2", "tree-3", "trees"]  # fmt: skip


@pytest.mark.parametrize("spelling", BAD)
def test_bad_spellings_list_the_accepted_ones(spelling: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_strategy(spelling)
    msg = str(info.value)
    for accepted in ("'centralized'", "'tree'", "'tree:K' (K >= 1)", "'ring'"):
        assert accepted in msg
    assert repr(spelling) in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("spelling", ["tree:0", "Tree:-2", " tree : 0 "])
def test_non_positive_arity(spelling: str) -> None:
    with pytest.raises(ConfigError, match=r"arity must be >= 1") as info:
        parse_strategy(spelling)
    assert "'ring'" in str(info.value)


@pytest.mark.parametrize("value", [None, 3, Tree, b"ring", ["ring"]])
def test_non_strings(value: object) -> None:
    with pytest.raises(ConfigError, match="accepted"):
        parse_strategy(value)  # type: ignore[arg-type]


def test_by_host_is_not_configured() -> None:
    """``ByHost`` needs the hosts the nodes announce: ``auto`` composes it, a config may not
    name it (its spelling leaves the hosts out, so nodes could not compare it)."""
    with pytest.raises(ConfigError, match="auto' composes by host"):
        parse_strategy(ByHost((0, 0, 1, 1), Ring()))
    with pytest.raises(ConfigError, match="auto' composes by host"):
        burncoll.CollectiveConfig(global_all_reduce_strategy=ByHost((0, 0, 1, 1), Ring()))
