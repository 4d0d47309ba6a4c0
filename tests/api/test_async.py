"""Asynchronous operations: ``async_op=True`` on every collective, and the :class:`Work` handle.

Real peers (threads of one node, 1-4 of them, and 2 nodes x 2 peers as threads of this process
with an in-process orchestrator over WebSocket) issue every collective with ``async_op=True``,
several in flight, then a blocking call behind them and the object collectives, and wait in
reverse order; every result is compared with a NumPy float64 reference built from every
rank's input. A mismatch issued asynchronously raises at ``wait`` on every peer; a
``wait(timeout=...)`` on an operation whose peers have not arrived raises
:class:`~burncoll.CollectiveTimeout` and the operation completes afterwards; ``finish`` waits
for pending work and leaves no worker thread. The queue itself (:mod:`burncoll.work`) is
tested on its own: order, failures, timeouts, callbacks, threads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.exchange as node_exchange
import burncoll.work
from burncoll.train import all_reduce_tree
from burncoll.work import OpQueue, Work, when_all
from tests.harness import run_nodes, run_peers

NDArray = np.ndarray[Any, Any]
WAIT = 30.0  # every wait of the tests is bounded


# -- inputs and references -----------------------------------------------------------------------
def _x(rank: int, name: str, shape: tuple[int, ...], dtype: str = "float32") -> NDArray:
    """Rank ``rank``'s input ``name``: random values, rounded so float32 sums are exact."""
    rng = np.random.default_rng([rank, sum(map(ord, name))])
    return (np.round(rng.normal(size=shape) * 64) / 64).astype(dtype)


def _script(comm: burncoll.Communicator) -> dict[str, Any]:
    """Every collective async, a blocking call and the object collectives behind them."""
    r, root = comm.rank, comm.peer_ids[-1]
    out = np.full((5, 3), np.nan, np.float32)
    works: dict[str, Work[Any]] = {
        "all_reduce": comm.all_reduce(_x(r, "ar", (7,)), async_op=True),
        "all_reduce_out": comm.all_reduce(_x(r, "out", (5, 3)), "max", out=out, async_op=True),
        "reduce": comm.reduce(_x(r, "red", (4, 2), "float64"), root, "mean", async_op=True),
        "broadcast": comm.broadcast(_x(r, "bc", (6,)) if comm.peer_id == root else None, root,
                                    async_op=True),
        "reduce_scatter": comm.reduce_scatter(_x(r, "rs", (9, 2)), async_op=True),
        "all_gather": comm.all_gather(_x(r, "ag", (r + 1, 2)), async_op=True),
        "barrier": comm.barrier(async_op=True),
        "all_reduce_2": comm.all_reduce(_x(r, "ar2", (3,), "int32"), "sum", async_op=True),
    }
    got: dict[str, Any] = {"blocking": comm.all_reduce(_x(r, "blk", (2, 2)), "min"),
                           "objects": comm.all_gather_object({"rank": r})}
    got["object"] = comm.broadcast_object(("from", r), root)
    for name in reversed(works):  # waited out of order
        got[name] = works[name].wait(timeout=WAIT)
    got["completed"] = all(w.is_completed() for w in works.values())
    got["out_is_out"] = got["all_reduce_out"] is out
    return got


def _check(results: list[Any], world: int) -> None:
    """Every rank's results of :func:`_script` against float64 references."""
    def inputs(name: str, shape: tuple[int, ...], dtype: str = "float32") -> list[NDArray]:
        return [_x(r, name, shape, dtype).astype(np.float64) for r in range(world)]

    root = world - 1
    expected_blocks = np.array_split(np.sum(inputs("rs", (9, 2)), axis=0), world)
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        assert got["completed"] and got["out_is_out"]
        np.testing.assert_allclose(got["all_reduce"], np.sum(inputs("ar", (7,)), axis=0),
                                   rtol=1e-6)
        np.testing.assert_array_equal(got["all_reduce_out"], np.max(inputs("out", (5, 3)), axis=0))
        if rank == root:
            np.testing.assert_allclose(got["reduce"], np.mean(inputs("red", (4, 2), "float64"),
                                                              axis=0), rtol=1e-12)
        else:
            assert got["reduce"] is None
        np.testing.assert_array_equal(got["broadcast"], _x(root, "bc", (6,)))
        np.testing.assert_allclose(got["reduce_scatter"], expected_blocks[rank], rtol=1e-6)
        np.testing.assert_array_equal(got["all_gather"], np.concatenate(
            [_x(r, "ag", (r + 1, 2)) for r in range(world)]))
        assert got["barrier"] is None
        assert got["all_reduce_2"].dtype == np.int32
        np.testing.assert_array_equal(got["all_reduce_2"],
                                      np.sum(inputs("ar2", (3,), "int32"), axis=0))
        np.testing.assert_array_equal(got["blocking"], np.min(inputs("blk", (2, 2)), axis=0))
        assert got["objects"] == [{"rank": r} for r in range(world)]
        assert got["object"] == ("from", root)


def _run_nodes(nodes: int, devices: int, fn: Callable[[burncoll.Communicator], Any],
               timeout: float = 10.0) -> list[Any]:
    """``fn(comm)`` on ``devices`` peers of each of ``nodes`` nodes (threads of this process,
    an in-process orchestrator, WebSocket); results (or errors) by rank."""
    with burncoll.start_orchestrator(transport="websocket", expected_nodes=nodes) as orch:
        got = run_nodes(orch.address, nodes, devices, fn, timeout=timeout)
    return [got.get(rank) for rank in range(nodes * devices)]


def _one_node(n: int, fn: Callable[[burncoll.Communicator], Any],
              timeout: float = 10.0) -> list[Any]:
    return run_peers(burncoll.CollectiveConfig(num_devices=n, timeout=timeout),
                     lambda comm, _i: fn(comm))


# -- every collective, in flight together ----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_async_on_one_node(n: int) -> None:
    _check(_one_node(n, _script), n)


def test_every_collective_async_on_two_nodes() -> None:
    _check(_run_nodes(2, 2, _script), 4)


def test_a_tree_reduced_async_equals_the_blocking_result_and_the_reference() -> None:
    def tree(rank: int) -> dict[str, Any]:
        return {"a": [_x(rank, f"t{i}", (i + 2, 3)) for i in range(5)],
                "b": (_x(rank, "tb", (40,), "float64"), _x(rank, "tc", (2,), "int64"))}

    def work(comm: burncoll.Communicator) -> tuple[Any, Any]:
        pending = all_reduce_tree(comm, tree(comm.rank), "sum", 64, async_op=True)
        blocking = all_reduce_tree(comm, tree(comm.rank), "sum", 64)
        return pending.wait(timeout=WAIT), blocking

    for results, world in ((_one_node(3, work), 3), (_run_nodes(2, 2, work), 4)):
        for got in results:
            assert not isinstance(got, BaseException), got
            pending, blocking = got
            trees = [tree(r) for r in range(world)]
            for i in range(5):
                want = np.sum([t["a"][i].astype(np.float64) for t in trees], axis=0)
                np.testing.assert_allclose(pending["a"][i], want, rtol=1e-6)
                np.testing.assert_array_equal(pending["a"][i], blocking["a"][i])
            for k, check in enumerate((np.testing.assert_allclose,
                                       np.testing.assert_array_equal)):
                check(pending["b"][k], np.sum([t["b"][k] for t in trees], axis=0))
            assert isinstance(pending["b"], tuple)


# -- errors and timeouts -------------------------------------------------------------------------
def _mismatch(comm: burncoll.Communicator) -> list[str]:
    first = comm.all_reduce(np.ones(3, np.float32), async_op=True)
    bad = comm.all_reduce(np.ones(4 + (comm.rank == 1), np.float32), async_op=True)
    after = comm.all_reduce(np.ones(2, np.float32), async_op=True)
    np.testing.assert_array_equal(first.wait(WAIT), np.full(3, comm.world_size, np.float32))
    kinds = []
    for work in (bad, after):
        with pytest.raises(burncoll.CollectiveError) as info:
            work.wait(WAIT)
        kinds.append(type(info.value).__name__)
        assert work.exception() is info.value
    return kinds


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_mismatch_issued_async_raises_at_wait_on_every_peer(nodes: int) -> None:
    results = _one_node(3, _mismatch) if nodes == 1 else _run_nodes(2, 2, _mismatch)
    for got in results:
        assert not isinstance(got, BaseException), got
        bad, after = got
        assert bad in ("MismatchError", "CollectiveAborted"), got
        assert after == "CollectiveAborted", got
    assert any(got[0] == "MismatchError" for got in results)


def test_a_mismatch_reported_by_a_node_ahead_waits_for_the_operation_it_finished(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 finishes the first all-reduce and finds the mismatch of the second one while
    node 1 has sent its part of the first but not yet received node 0's: node 0's abort
    arrives first (a test double holds node 1 there until it has). Node 1's first all-reduce
    still completes -- node 0 had sent everything for it -- and the mismatch surfaces at the
    second one's ``wait`` on every peer, not at the first's."""
    monkeypatch.setenv("BURNCOLL_SHARED_MEMORY", "0")  # (the exchange over member connections)
    real, held = node_exchange._receive_all, list[bool]()

    async def after_the_abort(executor: Any, core: Any, op: Any) -> Any:
        service = executor.service  # (node 1's message is sent: its sends run meanwhile)
        if service.node_index == 1 and op.seq == 0:
            end = time.monotonic() + WAIT
            while service.held is None and service.mailbox.error is None \
                    and time.monotonic() < end:
                await asyncio.sleep(0.001)
            held.append(time.monotonic() < end)
        return await real(executor, core, op)

    monkeypatch.setattr(node_exchange, "_receive_all", after_the_abort)
    with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
        got = run_nodes(orch.address, 2, 2, _mismatch, timeout=10.0, caller_sockets=False)
    assert held == [True], held  # node 1 waited for the abort (once: its one exchange)
    for rank in range(4):  # (node 1 may call the second after the failure applied: aborted)
        assert not isinstance(got[rank], BaseException), (rank, got[rank])
        assert got[rank][0] in (("MismatchError",) if rank < 2 else (
            "MismatchError", "CollectiveAborted")) and got[rank][1] == "CollectiveAborted", got


def test_a_broadcast_its_root_finished_completes_on_a_node_that_calls_it_after_the_abort(
        ) -> None:
    """Node 0 holds the root: its broadcast is done once sent, and the all-reduce after it
    is a mismatch there. Node 1's peers issue both only once node 0's abort has reached their
    node: the broadcast, which node 0 finished, still delivers the root's array, and the
    mismatch surfaces at the all-reduce's ``wait``."""
    def work(comm: burncoll.Communicator) -> tuple[list[float], str]:
        if comm.rank >= 2:  # node 1: wait for node 0's abort (its data service has it)
            service = comm._server.link._service  # type: ignore[union-attr]
            end = time.monotonic() + WAIT
            while service.held is None and service.mailbox.error is None \
                    and time.monotonic() < end:
                time.sleep(0.001)
        first = comm.broadcast(np.arange(3.0) if comm.rank == 0 else None, 0, async_op=True)
        bad = comm.all_reduce(np.ones(4 + (comm.rank == 1), np.float32), async_op=True)
        got = first.wait(WAIT).tolist()
        error = bad.exception(WAIT)
        assert isinstance(error, burncoll.CollectiveError), error
        return got, type(error).__name__

    for rank, got in enumerate(_run_nodes(2, 2, work)):
        assert not isinstance(got, BaseException), (rank, got)
        assert got[0] == [0.0, 1.0, 2.0], (rank, got)
        assert got[1] in ("MismatchError", "CollectiveAborted"), (rank, got)


def test_wait_with_a_timeout_raises_and_the_operation_completes_later() -> None:
    late = threading.Event()

    def work(comm: burncoll.Communicator) -> NDArray:
        if comm.rank == 0:
            pending = comm.all_reduce(np.full(3, 1.5), async_op=True)
            with pytest.raises(burncoll.CollectiveTimeout, match="still in flight"):
                pending.wait(timeout=0.01)
            assert not pending.is_completed()
            late.set()
            result: NDArray = pending.wait(timeout=WAIT)
            return result
        assert late.wait(WAIT)  # the others arrive only after rank 0's wait timed out
        result = comm.all_reduce(np.full(3, 1.5))
        return result

    for got in _one_node(3, work):
        np.testing.assert_array_equal(got, np.full(3, 4.5))


def test_finish_waits_for_pending_work_and_leaves_no_worker_thread() -> None:
    def work(comm: burncoll.Communicator) -> tuple[list[Work[Any]], str]:
        works = [comm.all_reduce(np.full(1000, float(i + comm.rank)), async_op=True)
                 for i in range(6)]
        comm.finish()
        return works, f"burncoll-peer-{comm.peer_id}"

    results = _one_node(4, work)
    alive = {t.name for t in threading.enumerate()}
    for works, worker in results:
        assert worker not in alive
        for i, w in enumerate(works):
            assert w.is_completed()
            np.testing.assert_array_equal(w.wait(0), np.full(1000, 4.0 * i + 6.0))


# -- the queue on its own ------------------------------------------------------------------------
def _thread_count(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_queue_runs_in_order_blocking_calls_wait_their_turn_and_no_thread_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    queue, seen = OpQueue("test-queue"), list[int]()
    gate = threading.Event()
    works = [queue.submit(lambda: gate.wait(WAIT) and seen.append(0), "first")]
    works += [queue.submit(lambda i=i: seen.append(i), f"op {i}") for i in range(1, 50)]
    assert not queue.idle() and _thread_count("test-queue") == 1
    assert not works[-1].is_completed()
    gate.set()
    assert queue.run(lambda: list(seen), "blocking") == list(range(50))
    assert queue.idle() and _thread_count("test-queue") == 0
    assert all(w.is_completed() for w in works)
    monkeypatch.setattr(burncoll.work, "LINGER_SECONDS", 0.0)  # the worker ends when idle
    for _ in range(50):  # the worker ending and a new submit racing: nothing lost
        work = queue.submit(lambda: 7, "again")
        assert work.wait(WAIT) == 7
    assert queue.wait_idle(WAIT) and _thread_count("test-queue") == 0


def test_a_failed_operation_fails_only_its_work() -> None:
    queue = OpQueue("test-failing")
    bad = queue.submit(lambda: 1 / 0, "divide")
    good = queue.submit(lambda: "fine", "after")
    with pytest.raises(ZeroDivisionError):
        bad.wait(WAIT)
    with pytest.raises(ZeroDivisionError):  # every wait raises the same error
        bad.result()
    assert isinstance(bad.exception(), ZeroDivisionError) and "failed" in repr(bad)
    assert good.wait(WAIT) == "fine" and good.exception() is None
    def raising() -> None:
        raise ValueError("ran")

    with pytest.raises(ValueError, match="ran"):  # a blocking operation raises in the caller
        queue.run(raising, "blocking")


@pytest.mark.parametrize("bad", [-1, float("nan"), True, "1"])
def test_wait_refuses_a_timeout_that_is_no_duration(bad: Any) -> None:
    work: Work[int] = Work("op")
    with pytest.raises(burncoll.UsageError, match="timeout"):
        work.wait(bad)
    with pytest.raises(burncoll.CollectiveTimeout):
        work.wait(0)
    work.set_result(3)
    work.set_exception(RuntimeError("late"))  # ignored: a Work completes once
    assert work.wait(float("inf")) == 3 and work.exception(0) is None


def test_callbacks_run_once_done_and_cannot_block_the_worker() -> None:
    queue = OpQueue("test-callbacks")
    gate, later_error, calls = threading.Event(), list[BaseException](), list[str]()
    first = queue.submit(lambda: gate.wait(WAIT), "first")
    second = queue.submit(lambda: 2, "second")

    def callback(work: Work[Any]) -> None:
        calls.append(work.label)
        for blocked in (lambda: second.wait(), lambda: queue.run(lambda: 0, "nested")):
            try:
                blocked()
            except burncoll.UsageError as exc:
                later_error.append(exc)

    first.add_done_callback(callback)
    gate.set()
    assert second.wait(WAIT) == 2
    assert calls == ["first"] and len(later_error) == 2
    second.add_done_callback(callback)  # done already: called at once, here
    assert calls == ["first", "second"]


def test_when_all_combines_results_or_raises_the_first_error() -> None:
    works: list[Work[int]] = [Work(f"w{i}") for i in range(3)]
    total = when_all(works, sum, "sum")
    for i, w in enumerate(reversed(works)):
        assert not total.is_completed()
        w.set_result(i + 1)
    assert total.wait(0) == 6
    failing: list[Work[int]] = [Work("a"), Work("b")]
    first = when_all(failing, sum, "sum")
    failing[1].set_exception(KeyError("second"))
    failing[0].set_exception(KeyError("first"))
    assert str(first.exception(WAIT)) == "'first'"
    assert when_all([], lambda results: len(results), "none").wait(0) == 0


def test_many_operations_in_flight_keep_their_order() -> None:
    def work(comm: burncoll.Communicator) -> list[NDArray]:
        works = [comm.all_reduce(np.full(4, float(i * (comm.rank + 1))), async_op=True)
                 for i in range(40)]
        time.sleep(0.01 * comm.rank)  # the peers wait at different times
        return [w.wait(WAIT) for w in reversed(works)][::-1]

    for got in _one_node(3, work):
        for i, result in enumerate(got):
            np.testing.assert_array_equal(result, np.full(4, 6.0 * i))
