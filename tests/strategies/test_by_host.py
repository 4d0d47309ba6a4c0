"""``ByHost``: every schedule kind over many layouts of nodes on hosts, played symbolically.

The final states are checked as for the flat strategies (``test_strategy_semantics``), and the
bytes that leave each host are counted against what the composition promises: the inner
strategy's own traffic among the hosts, nothing more.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from burncoll.strategies import Action, Centralized, Doubling, Ring, Schedule, Strategy, Tree
from burncoll.strategies._checks import validate_schedule
from burncoll.strategies.by_host import ByHost, host_groups

from .simulator import full, leaf, only_owners, only_root, own_data, play

SETTINGS = settings(max_examples=150, deadline=None)

inners: st.SearchStrategy[Strategy] = st.one_of(
    st.just(Centralized()), st.builds(Tree, st.integers(1, 4)), st.just(Ring()))
#: Host of each node: 1-12 nodes on 1-4 hosts, in any order (interleaved included).
layouts = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple)


@st.composite
def layout_root(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    hosts = draw(layouts)
    return hosts, draw(st.integers(0, len(hosts) - 1))


@st.composite
def layout_owners(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    hosts = draw(layouts)
    return hosts, tuple(draw(st.lists(st.integers(0, len(hosts) - 1), max_size=14)))


def _played(sched: Schedule, world: int) -> None:
    assert sched.world == world
    validate_schedule(sched)
    assert all(sched.rounds), "empty rounds are dropped"


def _out_of_hosts(sched: Schedule, hosts: tuple[int, ...], size: int) -> Counter[int]:
    """Bytes each host sends to other hosts for an array of ``size`` bytes."""
    chunk = Fraction(size, sched.num_chunks)
    sent: Counter[int] = Counter()
    for rnd in sched.rounds:
        for s in rnd:
            if hosts[s.src] != hosts[s.dst]:
                sent[hosts[s.src]] += chunk  # type: ignore[assignment]
    return sent


@SETTINGS
@given(inners, layouts)
@example(Ring(), (0, 0, 1, 1))
@example(Ring(), (0, 1, 0, 1))
@example(Ring(), (0, 0, 0, 1))
@example(Tree(2), (2, 2, 2))
def test_all_reduce(inner: Strategy, hosts: tuple[int, ...]) -> None:
    world = len(hosts)
    sched = ByHost(hosts, inner).all_reduce(world)
    _played(sched, world)
    state = play(sched, own_data(world, sched.num_chunks)).state
    for c in range(sched.num_chunks):
        values = [state[p][c] for p in range(world)]
        assert all(v is not None and v.counts == full(world) for v in values)
        assert len({v.expr for v in values if v is not None}) == 1  # computed once, copied


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1, 2, 2), (0, 1, 1, 2, 2, 2, 3), (0,) * 4,
                                   tuple(range(5)), (0, 1) * 4])
def test_doubling_among_hosts_is_an_exchange_schedule(hosts: tuple[int, ...]) -> None:
    """ByHost is an exchange strategy exactly when its inner strategy is: the walk that runs
    it (and the config's refusal of exchanges for the threads of a node) follows the flag."""
    by_host = ByHost(hosts, Doubling())
    assert by_host.exchanges and not ByHost(hosts, Ring()).exchanges
    world = len(hosts)
    sched = by_host.all_reduce(world)
    validate_schedule(sched, exchanges=True)
    state = play(sched, own_data(world, sched.num_chunks), exchanges=True).state
    assert all(v is not None and v.counts == full(world) for row in state for v in row)


@SETTINGS
@given(inners, layout_root())
def test_reduce(inner: Strategy, hr: tuple[tuple[int, ...], int]) -> None:
    hosts, root = hr
    sched = ByHost(hosts, inner).reduce(len(hosts), root)
    _played(sched, len(hosts))
    state = play(sched, own_data(len(hosts), sched.num_chunks)).state
    assert all(v is not None and v.counts == full(len(hosts)) for v in state[root])


@SETTINGS
@given(inners, layout_root())
def test_broadcast(inner: Strategy, hr: tuple[tuple[int, ...], int]) -> None:
    hosts, root = hr
    sched = ByHost(hosts, inner).broadcast(len(hosts), root)
    _played(sched, len(hosts))
    assert all(s.action.name == "COPY" for rnd in sched.rounds for s in rnd)
    state = play(sched, only_root(len(hosts), sched.num_chunks, root)).state
    assert all(v == leaf(root) for row in state for v in row)


@SETTINGS
@given(inners, layout_owners())
@example(Ring(), ((0, 0, 1, 1), (3, 3, 1, 0, 2)))
def test_reduce_scatter(inner: Strategy, ho: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    hosts, owners = ho
    sched = ByHost(hosts, inner).reduce_scatter(len(hosts), owners)
    _played(sched, len(hosts))
    assert sched.num_chunks == len(owners)
    state = play(sched, own_data(len(hosts), len(owners))).state
    for c, o in enumerate(owners):
        v = state[o][c]
        assert v is not None and v.counts == full(len(hosts))


@SETTINGS
@given(inners, layout_owners())
@example(Ring(), ((0, 1, 0, 1), (3, 3, 1, 0, 2)))
def test_all_gather(inner: Strategy, ho: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    hosts, owners = ho
    sched = ByHost(hosts, inner).all_gather(len(hosts), owners)
    _played(sched, len(hosts))
    assert all(s.action.name == "COPY" for rnd in sched.rounds for s in rnd)
    state = play(sched, only_owners(len(hosts), owners)).state
    for row in state:
        for c, o in enumerate(owners):
            assert row[c] is not None and row[c].counts == Counter({o: 1})  # type: ignore[union-attr]


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 1, 0, 1), (5, 5, 5, 7, 7, 7),
                                   (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2)])
def test_each_host_sends_what_a_ring_among_the_hosts_sends(hosts: tuple[int, ...]) -> None:
    """Equal hosts: each host sends 2 (H - 1) / H of the array to other hosts (the ring's
    bound among H participants), spread over its nodes -- less than a flat ring, which
    sends 2 (N - 1) / N of it across every host boundary it crosses."""
    size, world = 1 << 20, len(hosts)
    count = len(set(hosts))
    layered = _out_of_hosts(ByHost(hosts, Ring()).all_reduce(world), hosts, size)
    assert set(layered.values()) == {Fraction(2 * (count - 1), count) * size}
    flat = _out_of_hosts(Ring().all_reduce(world), hosts, size)
    assert all(flat[h] > layered[h] for h in set(hosts))


def test_each_node_of_a_host_carries_its_share_between_hosts() -> None:
    """2 hosts x 3 nodes: node j of each host sends shard j (a third of the array) across,
    so no node carries the whole host's traffic."""
    hosts = (0, 0, 0, 1, 1, 1)
    sched = ByHost(hosts, Ring()).all_reduce(6)
    per_node: Counter[int] = Counter()
    for rnd in sched.rounds:
        for s in rnd:
            if hosts[s.src] != hosts[s.dst]:
                per_node[s.src] += 1
    # 6 chunks of a sixth: each node sends its shard's two halves once each way
    assert sched.num_chunks == 6 and per_node == Counter(dict.fromkeys(range(6), 2))


def test_unequal_hosts_go_through_one_leader_each() -> None:
    hosts = (0, 0, 0, 1)
    sched = ByHost(hosts, Ring()).all_reduce(4)
    crossing = {(s.src, s.dst) for rnd in sched.rounds for s in rnd
                if hosts[s.src] != hosts[s.dst]}
    assert crossing == {(0, 3), (3, 0)}


def test_rooted_operations_lead_from_the_root() -> None:
    """The root leads its own host: nothing waits on a hop from another node of it."""
    hosts = (0, 0, 1, 1)
    reduce = ByHost(hosts, Tree(2)).reduce(4, 1)
    assert {s.dst for s in reduce.rounds[-1]} == {1}
    broadcast = ByHost(hosts, Tree(2)).broadcast(4, 3)
    assert {s.src for s in broadcast.rounds[0]} == {3}


def test_groups_and_arguments() -> None:
    assert host_groups((4, 1, 4, 1, 9)) == ((0, 2), (1, 3), (4,))
    strategy = ByHost((0, 0, 1), Ring())
    assert strategy.spec == "by-host(ring)"
    assert strategy == ByHost((0, 0, 1), Ring()) and hash(strategy) == hash(ByHost((0, 0, 1),
                                                                                 Ring()))
    assert strategy.all_reduce(3) is strategy.all_reduce(3)
    with pytest.raises(ValueError, match="hosts of 3 participants, not 4"):
        strategy.all_reduce(4)
    with pytest.raises(ValueError):
        strategy.reduce(3, 3)
    with pytest.raises(ValueError):
        strategy.all_gather(3, (0, 5))


@SETTINGS
@given(inners, layout_owners())
@example(Ring(), ((0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5, 6, 7)))
@example(Ring(), ((0, 0, 0, 1), (3,)))
def test_inside_a_host_a_node_reduces_one_sender_at_a_time(
        inner: Strategy, ho: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """Parts of several senders reduced into one node in the same round wait in its mailbox
    for their turn (a host of k nodes: up to k - 2 arrays); inside a host no round has two."""
    hosts, owners = ho
    strategy, world = ByHost(hosts, inner), len(hosts)
    for sched in (strategy.all_reduce(world), strategy.reduce(world, world - 1),
                  strategy.reduce_scatter(world, owners)):
        for rnd in sched.rounds:
            senders: dict[int, set[int]] = {}
            for s in rnd:
                if s.action is Action.REDUCE and hosts[s.src] == hosts[s.dst]:
                    senders.setdefault(s.dst, set()).add(s.src)
            assert all(len(srcs) == 1 for srcs in senders.values()), (hosts, rnd)
