"""The spinning policy of the caller sockets (``burncoll.node.spinning``): a node spins only
where its host has a CPU for it and while the waits it sees are short; long waits (a busy
host) stop it, and short ones start it again. A wait for shared mail yields its CPU first,
until a yield takes as long as a busy host's time slice; then the next waits sleep at once,
and yielding is tried again after them. The engine itself spins and sleeps on real sockets in
``tests/node/test_lanes.py``, and waits for real mail in ``tests/node/test_host_memory.py``."""

from __future__ import annotations

import burncoll.node.spinning as spinning
from burncoll.node.spinning import (
    LONGEST,
    PAYS_BELOW,
    SLEEPS_AFTER_SLOW_YIELD,
    SLOW_YIELD,
    YIELDS,
    Spinning,
    Yielding,
    usable_cpus,
)


def test_a_node_spins_only_where_its_host_has_the_cpus() -> None:
    assert Spinning(allowed=False).budget() == 0.0
    assert Spinning(allowed=True).budget() == LONGEST
    assert 0 < LONGEST < PAYS_BELOW


def test_long_waits_stop_the_spinning_and_short_ones_start_it_again() -> None:
    policy = Spinning(allowed=True)
    for _ in range(40):  # a busy host: the other node's messages come late
        policy.waited(10 * PAYS_BELOW)
    assert policy.budget() == 0.0
    assert policy.average > PAYS_BELOW
    for _ in range(40):  # quiet again
        policy.waited(PAYS_BELOW / 10)
    assert policy.budget() == LONGEST
    assert policy.average < PAYS_BELOW


def test_one_late_message_among_short_waits_does_not_stop_it() -> None:
    policy = Spinning(allowed=True)
    for _ in range(20):
        policy.waited(PAYS_BELOW / 10)
    policy.waited(3 * PAYS_BELOW)
    assert policy.budget() == LONGEST


def test_the_cpus_counted_are_those_this_process_may_use() -> None:
    assert 1 <= usable_cpus() <= (spinning.os.cpu_count() or 1)


def test_a_slow_yield_makes_the_next_waits_sleep_at_once_then_yielding_is_tried_again(
        ) -> None:
    policy = Yielding()
    assert policy.budget() == YIELDS
    assert policy.yielded(SLOW_YIELD / 10)  # another node process ran: go on
    assert policy.budget() == YIELDS
    assert not policy.yielded(2 * SLOW_YIELD)  # a whole time slice elsewhere: stop
    assert [policy.budget() for _ in range(SLEEPS_AFTER_SLOW_YIELD)] == [
        0.0] * SLEEPS_AFTER_SLOW_YIELD
    assert policy.budget() == YIELDS
