"""Communicator groups: ``split`` and ``group`` over real peer threads and real nodes (threads of
this process talking over loopback sockets), checked against NumPy float64 references."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.errors import CollectiveTimeout, MismatchError, UsageError
from tests.harness import run_nodes, run_peers

ORCHESTRATOR_THREAD = "burncoll-orchestrator"


def _data(rank: int, salt: int, n: int = 6) -> np.ndarray:
    return np.random.default_rng(1000 * salt + rank).standard_normal(n)


def _ops(g: burncoll.Communicator, salt: int) -> None:
    """all_reduce, broadcast from the last group rank, all_gather: against NumPy."""
    members = g.parent_ranks
    assert members is not None
    n = len(members)
    assert (g.peer_id, g.world_size, g.peer_ids) == (g.rank, n, tuple(range(n)))
    x = _data(members[g.rank], salt)
    want = np.sum(np.stack([_data(p, salt) for p in members]), axis=0)
    np.testing.assert_allclose(g.all_reduce(x), want, rtol=1e-12, atol=1e-12)
    root = n - 1
    got = g.broadcast(x if g.rank == root else None, root)
    np.testing.assert_array_equal(got, _data(members[root], salt))
    gathered = g.all_gather(x[: g.rank + 1])
    np.testing.assert_array_equal(
        gathered, np.concatenate([_data(p, salt)[: r + 1] for r, p in enumerate(members)]))


def _two_d(comm: burncoll.Communicator) -> list[burncoll.Communicator]:
    """Data-parallel groups {0, 2}, {1, 3} by split; tensor-parallel {0, 1}, {2, 3} by group
    (every peer makes both); each peer uses both, and the parent, in turn."""
    r = comm.rank
    dp = comm.split(r % 2)
    tps = [comm.group([0, 1]), comm.group([2, 3])]
    assert dp is not None and tps[1 - r // 2] is None
    tp = tps[r // 2]
    assert tp is not None
    assert (dp.parent_ranks, tp.parent_ranks) == ((r % 2, r % 2 + 2), (r // 2 * 2, r // 2 * 2 + 1))
    for step in range(3):
        x = _data(r, 10 + step)
        work = dp.all_reduce(x, async_op=True)  # in flight while tp reduces
        in_tp = tp.all_reduce(2 * x)
        in_dp = work.wait(timeout=30)
        whole = comm.all_reduce(x)
        each = [_data(p, 10 + step) for p in range(4)]
        np.testing.assert_allclose(in_dp, each[r % 2] + each[r % 2 + 2], rtol=1e-12)
        np.testing.assert_allclose(in_tp, 2 * (each[r // 2 * 2] + each[r // 2 * 2 + 1]),
                                   rtol=1e-12)
        np.testing.assert_allclose(whole, np.sum(np.stack(each), axis=0), rtol=1e-12)
    return [dp, tp]


def _scenario(comm: burncoll.Communicator) -> tuple[int | None, ...]:
    """Splits and groups of a 4-peer communicator; their operations; finish them all."""
    r, made = comm.rank, []
    reverse = comm.split(r % 2, key=-r)  # keys reverse the parent's order
    assert reverse is not None
    assert reverse.parent_ranks == tuple(p for p in (3, 2, 1, 0) if p % 2 == r % 2)
    _ops(reverse, 1)
    some = comm.split(None if r == 0 else 7)  # rank 0 joins no group
    assert (some is None) == (r == 0)
    if some is not None:
        assert some.parent_ranks == (1, 2, 3)
        _ops(some, 2)
    pair = comm.group([2, 1])  # ordered by parent rank, as torch's new_group
    assert (pair is None) == (r not in (1, 2))
    if pair is not None:
        assert pair.parent_ranks == (1, 2)
        _ops(pair, 3)
        inner = pair.split(0, key=-pair.rank)  # a group of a group
        assert inner is not None and inner.parent_ranks == (1, 0)
        _ops_inner = inner.all_reduce(np.array([float(r)]))
        assert _ops_inner.tolist() == [3.0]
        inner.finish()
    made += [reverse, some, pair, *_two_d(comm)]
    for g in made:
        if g is not None:
            g.finish()
    return reverse.parent_ranks or ()


def _no_threads_left(before: set[threading.Thread]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            return
        time.sleep(0.05)
    pytest.fail(f"threads left behind: {[t.name for t in extra]}")


def _run_nodes(address: str, nodes: int, devices: int, transport: str,
               fn: Callable[[burncoll.Communicator], Any]) -> list[Any]:
    got = run_nodes(address, nodes, devices, fn, transport=transport, timeout=10)
    return [got.get(rank) for rank in range(nodes * devices)]


def _ok(results: list[Any]) -> None:
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), (rank, got)


def test_groups_of_one_node() -> None:
    before = set(threading.enumerate())
    results = run_peers(burncoll.CollectiveConfig(num_devices=4, timeout=10),
                        lambda comm, _: _scenario(comm))
    _ok(results)
    _no_threads_left(before)


@pytest.mark.parametrize("transport", ["websocket", "quic"])
def test_groups_across_two_nodes(transport: str) -> None:
    before = set(threading.enumerate())
    with burncoll.start_orchestrator(transport=transport, expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 2, transport, _scenario)
    _ok(results)
    _no_threads_left(before)


# -- disagreement: the same UsageError on every peer, at once ---------------------------------
BAD: list[tuple[Callable[[burncoll.Communicator], object], str]] = [
    (lambda c: c.group([0, 1, 2] if c.rank == 3 else [0, 1]),
     "group: every peer must pass the same ranks; rank(s) 0, 1, 2 passed [0, 1]; "
     "rank(s) 3 passed [0, 1, 2]"),
    (lambda c: c.group(range(2) if c.rank else (1, 0)),  # the same ranks, listed otherwise
     "rank(s) 0 passed [1, 0]; rank(s) 1, 2, 3 passed [0, 1]"),
    (lambda c: c.split("a" if c.rank == 1 else 0), "rank 1 passed color='a' (str)"),
    (lambda c: c.split(-1 if c.rank == 2 else 0, key=1.5 if c.rank == 3 else None),
     "rank 2 passed color=-1; rank 3 passed key=1.5 (float)"),
    (lambda c: c.group([0, 4]), "rank 0 passed [0, 4]: [4] out of range"),
    (lambda c: c.group([1, 1] if c.rank == 2 else [1]), "rank 2 passed [1, 1]: [1] listed twice"),
    (lambda c: c.group({0, 1}), "rank 0 passed {0, 1} (set): not a list of ranks"),
    (lambda c: c.split(0) if c.rank == 0 else c.group([0]),
     "rank 0 called split; rank 1 called group"),
]


def _disagree(comm: burncoll.Communicator) -> list[str]:
    messages = []
    for call, _ in BAD:
        with pytest.raises(UsageError) as info:
            call(comm)
        assert not isinstance(info.value, CollectiveTimeout)
        messages.append(str(info.value))
    assert comm.all_reduce(np.ones(2)).tolist() == [4.0, 4.0]  # the parent goes on
    return messages


def _check_disagreement(results: list[Any]) -> None:
    _ok(results)
    assert all(got == results[0] for got in results)  # the same message on every peer
    for message, (_, want) in zip(results[0], BAD, strict=True):
        assert want in message, (message, want)


def test_disagreement_raises_the_same_usage_error_everywhere() -> None:
    results = run_peers(burncoll.CollectiveConfig(num_devices=4, timeout=10),
                        lambda comm, _: _disagree(comm))
    _check_disagreement(results)


def test_disagreement_across_nodes() -> None:
    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 2, "websocket", _disagree)
    _check_disagreement(results)


def test_the_parents_finish_closes_the_orchestrator_of_a_failed_group() -> None:
    before = set(threading.enumerate())

    def orchestrators() -> int:
        return sum(t.name == ORCHESTRATOR_THREAD for t in threading.enumerate())

    def fn(comm: burncoll.Communicator) -> tuple[int, int]:
        group = comm.split(0, key=-comm.rank)  # spans both nodes; hosted by node 1
        assert group is not None
        hosting = orchestrators()
        with pytest.raises(MismatchError):
            group.all_reduce(np.ones(2 + comm.rank))
        comm.finish()  # the parent first: the failed group's orchestrator goes with it
        left = orchestrators()
        group.finish()
        return hosting, left

    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 1, "websocket", fn)
    _ok(results)
    assert results[1] == (2, 1)  # node 1 hosted the group's; the test's own is left
    _no_threads_left(before)
