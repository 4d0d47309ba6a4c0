"""Every strategy, every schedule kind, many worlds/roots/owners: the final symbolic state.

Chunk contents are Counters of contributing participants (see ``simulator``), so a reduction
that misses a participant or counts one twice shows up, as does a broadcast that reduces.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from burncoll.strategies import Centralized, Ring, Schedule, Strategy, Tree
from burncoll.strategies._checks import validate_schedule

from .simulator import full, leaf, only_owners, only_root, own_data, play

MAX_WORLD = 33
SETTINGS = settings(max_examples=200, deadline=None)

strategies_st: st.SearchStrategy[Strategy] = st.one_of(
    st.just(Centralized()), st.builds(Tree, st.integers(1, 8)), st.just(Ring())
)
worlds = st.integers(1, MAX_WORLD)


@st.composite
def world_root(draw: st.DrawFn) -> tuple[int, int]:
    world = draw(worlds)
    return world, draw(st.integers(0, world - 1))


@st.composite
def world_owners(draw: st.DrawFn) -> tuple[int, tuple[int, ...]]:
    """Owners tuples: uniform, concentrated on a few owners (several chunks each, many
    participants owning none), one per participant in a shuffled order, or empty."""
    world = draw(worlds)
    anyone = st.integers(0, world - 1)
    few = st.lists(anyone, min_size=1, max_size=3, unique=True).flatmap(
        lambda subset: st.lists(st.sampled_from(subset), max_size=3 * world)
    )
    owners = draw(
        st.one_of(
            st.lists(anyone, max_size=2 * world + 2),
            few,
            st.permutations(range(world)),
        )
    )
    return world, tuple(owners)


def _check_structure(sched: Schedule, world: int) -> None:
    assert sched.world == world
    validate_schedule(sched)
    if world == 1:
        assert sched.rounds == ()
    assert all(sched.rounds), "empty rounds are dropped"


@SETTINGS
@given(strategies_st, worlds)
@example(Ring(), 2)
@example(Tree(1), MAX_WORLD)
def test_all_reduce(strategy: Strategy, world: int) -> None:
    sched = strategy.all_reduce(world)
    _check_structure(sched, world)
    assert sched.num_chunks >= 1
    state = play(sched, own_data(world, sched.num_chunks)).state
    for c in range(sched.num_chunks):
        values = [state[p][c] for p in range(world)]
        assert all(v is not None and v.counts == full(world) for v in values)
        # Computed once, then copied: every participant holds the same reduction tree, so
        # floating-point results are bitwise identical everywhere.
        assert len({v.expr for v in values if v is not None}) == 1


@SETTINGS
@given(strategies_st, world_root())
def test_reduce(strategy: Strategy, wr: tuple[int, int]) -> None:
    world, root = wr
    sched = strategy.reduce(world, root)
    _check_structure(sched, world)
    state = play(sched, own_data(world, sched.num_chunks)).state
    for v in state[root]:
        assert v is not None and v.counts == full(world)


@SETTINGS
@given(strategies_st, world_root())
def test_broadcast(strategy: Strategy, wr: tuple[int, int]) -> None:
    world, root = wr
    sched = strategy.broadcast(world, root)
    _check_structure(sched, world)
    assert all(s.action.name == "COPY" for rnd in sched.rounds for s in rnd)
    state = play(sched, only_root(world, sched.num_chunks, root)).state
    assert all(v == leaf(root) for row in state for v in row)


@SETTINGS
@given(strategies_st, world_owners())
@example(Ring(), (5, (3, 3, 3, 0)))
@example(Tree(2), (7, ()))
def test_reduce_scatter(strategy: Strategy, wo: tuple[int, tuple[int, ...]]) -> None:
    world, owners = wo
    sched = strategy.reduce_scatter(world, owners)
    _check_structure(sched, world)
    assert sched.num_chunks == len(owners)
    state = play(sched, own_data(world, len(owners))).state
    for c, o in enumerate(owners):
        v = state[o][c]
        assert v is not None and v.counts == full(world)


@SETTINGS
@given(strategies_st, world_owners())
@example(Ring(), (5, (3, 3, 3, 0)))
@example(Tree(3), (9, (8, 8, 4)))
def test_all_gather(strategy: Strategy, wo: tuple[int, tuple[int, ...]]) -> None:
    world, owners = wo
    sched = strategy.all_gather(world, owners)
    _check_structure(sched, world)
    assert sched.num_chunks == len(owners)
    assert all(s.action.name == "COPY" for rnd in sched.rounds for s in rnd)
    state = play(sched, only_owners(world, owners)).state
    for row in state:
        for c, o in enumerate(owners):
            v = row[c]
            assert v is not None and v.counts == Counter({o: 1})


ALL = [Centralized(), Tree(1), Tree(2), Tree(5), Ring()]


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.spec)
def test_world_one_is_empty(strategy: Strategy) -> None:
    for sched in (strategy.reduce(1, 0), strategy.broadcast(1, 0), strategy.all_reduce(1)):
        assert sched.world == 1 and sched.num_chunks == 1 and sched.rounds == ()
    for owners in [(), (0,), (0, 0, 0)]:
        for sched in (strategy.reduce_scatter(1, owners), strategy.all_gather(1, owners)):
            assert sched.num_chunks == len(owners) and sched.rounds == ()


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.spec)
def test_schedules_are_cached_and_deterministic(strategy: Strategy) -> None:
    assert strategy.all_reduce(9) is strategy.all_reduce(9)
    assert strategy.reduce(9, 4) is strategy.reduce(9, 4)
    assert strategy.broadcast(9, 4) is strategy.broadcast(9, 4)
    assert strategy.reduce_scatter(9, (1, 1, 5)) is strategy.reduce_scatter(9, (1, 1, 5))
    assert strategy.all_gather(9, (1, 1, 5)) is strategy.all_gather(9, (1, 1, 5))
    # Equal value objects share the cache.
    same = type(strategy)(strategy.arity) if isinstance(strategy, Tree) else type(strategy)()
    assert same == strategy and hash(same) == hash(strategy)
    assert same.all_reduce(9) is strategy.all_reduce(9)


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.spec)
def test_bad_arguments_raise_value_error(strategy: Strategy) -> None:
    with pytest.raises(ValueError):
        strategy.all_reduce(0)
    with pytest.raises(ValueError):
        strategy.reduce(3, 3)
    with pytest.raises(ValueError):
        strategy.broadcast(3, -1)
    with pytest.raises(ValueError):
        strategy.reduce_scatter(3, (0, 3))
    with pytest.raises(ValueError):
        strategy.all_gather(3, (-1,))


def test_value_objects() -> None:
    assert Centralized().spec == "centralized"
    assert Ring().spec == "ring"
    assert Tree(3).spec == "tree:3"
    assert Tree(3) == Tree(3) and Tree(3) != Tree(4)
    distinct: list[Strategy] = [Tree(2), Ring(), Centralized()]
    assert all(a != b for i, a in enumerate(distinct) for b in distinct[i + 1 :])
    assert len({Tree(3), Tree(3), Ring(), Ring(), Centralized()}) == 3
    with pytest.raises(AttributeError):
        Tree(3).arity = 4  # type: ignore[misc]


@pytest.mark.parametrize("arity", [0, -1, True, 2.0, "2"])
def test_tree_arity_is_validated(arity: object) -> None:
    with pytest.raises(ValueError, match="arity"):
        Tree(arity)  # type: ignore[arg-type]
