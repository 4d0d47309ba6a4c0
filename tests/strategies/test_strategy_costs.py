"""Costs: rounds and bytes per participant, measured by playing the schedules."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burncoll.strategies import Centralized, Ring, Tree
from burncoll.strategies.base import default_owners

from .simulator import only_owners, only_root, own_data, play

WORLDS = range(1, 34)
ARITIES = range(1, 9)
S = 1 << 20  # bytes of the array; chunk sizes are exact Fractions


def heap_depth(world: int, arity: int) -> int:
    """Depth of a ``world``-node ``arity``-ary heap: the least d with 1 + b + ... + b^d >= N."""
    depth, capacity, width = 0, 1, 1
    while capacity < world:
        depth += 1
        width *= arity
        capacity += width
    return depth


def test_heap_depth_reference() -> None:
    assert [heap_depth(n, 2) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert [heap_depth(n, 1) for n in (1, 2, 5)] == [0, 1, 4]
    assert [heap_depth(n, 3) for n in (1, 4, 5, 13, 14)] == [0, 1, 2, 2, 3]


@pytest.mark.parametrize("arity", ARITIES)
def test_tree_reduce_and_broadcast_rounds_are_the_heap_depth(arity: int) -> None:
    tree = Tree(arity)
    for world in WORLDS:
        depth = heap_depth(world, arity)
        if arity == 1:
            assert depth == world - 1  # a chain
        elif world > 1:
            # O(log_b N): depth <= ceil(log_b N), i.e. b^(depth-1) < N.
            assert arity ** (depth - 1) < world
        for root in range(world):
            for sched in (tree.reduce(world, root), tree.broadcast(world, root)):
                assert len(sched.rounds) == depth
        assert len(tree.all_reduce(world).rounds) == 2 * depth


@pytest.mark.parametrize("arity", ARITIES)
def test_tree_fan_in_and_bytes(arity: int) -> None:
    tree = Tree(arity)
    for world in WORLDS:
        root = world // 2
        res = play(tree.reduce(world, root), own_data(world, 1), size=S)
        assert res.max_fan_in <= arity  # a node receives at most one message per child
        assert all(res.bytes_sent[p] == (0 if p == root else S) for p in range(world))
        res = play(tree.broadcast(world, root), only_root(world, 1, root), size=S)
        assert all(res.bytes_received[p] == (0 if p == root else S) for p in range(world))
        assert all(b <= arity * S for b in res.bytes_sent)


@given(
    st.integers(1, 8),
    st.integers(2, 33).flatmap(
        lambda w: st.tuples(st.just(w), st.lists(st.integers(0, w - 1), min_size=1, max_size=70))
    ),
)
@settings(max_examples=100, deadline=None)
def test_tree_scatter_gather_rounds_are_logarithmic(arity: int, wo: tuple[int, list[int]]) -> None:
    world, owners_list = wo
    owners = tuple(owners_list)
    depth = heap_depth(world, arity)
    tree = Tree(arity)
    assert len(tree.reduce_scatter(world, owners).rounds) <= depth + 1
    sched = tree.all_gather(world, owners)
    assert len(sched.rounds) <= 2 * depth
    # Nothing is sent to a participant that already holds it: everyone but the owner receives
    # each chunk exactly once.
    res = play(sched, only_owners(world, owners), size=len(owners))
    for p in range(world):
        assert res.bytes_received[p] == sum(1 for o in owners if o != p)


@pytest.mark.parametrize("world", WORLDS)
def test_ring_all_reduce_is_bandwidth_optimal(world: int) -> None:
    sched = Ring().all_reduce(world)
    assert sched.num_chunks == world
    res = play(sched, own_data(world, world), size=S)
    assert res.rounds == 2 * (world - 1)
    expected = Fraction(2 * (world - 1), world) * S
    assert res.bytes_sent == [expected] * world
    assert res.bytes_received == [expected] * world
    assert res.max_fan_in <= 1


@pytest.mark.parametrize("world", WORLDS)
def test_ring_other_costs(world: int) -> None:
    ring = Ring()
    owners = default_owners(world)
    half = Fraction(world - 1, world) * S
    res = play(ring.reduce_scatter(world, owners), own_data(world, world), size=S)
    assert res.rounds == world - 1 and res.bytes_sent == [half] * world
    res = play(ring.all_gather(world, owners), only_owners(world, owners), size=S)
    assert res.rounds == world - 1 and res.bytes_sent == [half] * world
    for root in {0, world // 2, world - 1}:
        expected_rounds = world if world > 1 else 0
        assert len(ring.reduce(world, root).rounds) == expected_rounds
        assert len(ring.broadcast(world, root).rounds) == expected_rounds


@given(
    st.integers(2, 33).flatmap(
        lambda w: st.tuples(st.just(w), st.lists(st.integers(0, w - 1), min_size=1, max_size=70))
    )
)
@settings(max_examples=100, deadline=None)
def test_ring_scatter_gather_take_n_minus_1_rounds(wo: tuple[int, list[int]]) -> None:
    world, owners_list = wo
    owners = tuple(owners_list)
    ring = Ring()
    assert len(ring.reduce_scatter(world, owners).rounds) == world - 1
    assert len(ring.all_gather(world, owners).rounds) == world - 1


@pytest.mark.parametrize("world", WORLDS)
def test_centralized_rounds(world: int) -> None:
    c = Centralized()
    one = 1 if world > 1 else 0
    assert len(c.all_reduce(world).rounds) == 2 * one
    assert len(c.reduce(world, world - 1).rounds) == one
    assert len(c.broadcast(world, world - 1).rounds) == one
    owners = default_owners(world)
    assert len(c.reduce_scatter(world, owners).rounds) == 2 * one
    assert len(c.all_gather(world, owners).rounds) == 2 * one
    res = play(c.all_reduce(world), own_data(world, 1), size=S)
    assert res.bytes_received[0] == (world - 1) * S
