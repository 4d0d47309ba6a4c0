"""DataParallel.run: one real thread and one real registered peer per device."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.train import all_reduce_tree, ddp, node_rank
from tests.train._util import (
    bitwise_equal,
    config,
    ddp_threads,
    max_abs_diff,
    nested_grad,
    nested_params,
    nested_step,
    regression_data,
)

STEPS = 40


def test_run_returns_results_in_device_order() -> None:
    def worker(comm: burncoll.Communicator) -> tuple[int, int, int]:
        return comm.peer_id, comm.rank, comm.world_size

    assert ddp(range(4), config()).run(worker) == [(i, i, 4) for i in range(4)]
    assert ddp_threads() == []


def test_ddp_fills_in_num_devices_and_accepts_device_objects() -> None:
    devices = burncoll.get_backend("numpy").devices(3)
    dp = ddp(devices, config(num_devices=1))
    assert dp.config.num_devices == 3
    assert dp.run(lambda comm: comm.device) == devices


def test_ddp_rejects_bad_device_lists() -> None:
    with pytest.raises(burncoll.UsageError, match="at least one device"):
        ddp([], config())
    with pytest.raises(burncoll.UsageError, match="twice"):
        ddp([0, 0], config())


def test_node_rank_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BURNCOLL_NODE_RANK", raising=False)
    assert node_rank() == 0
    monkeypatch.setenv("BURNCOLL_NUM_NODES", "4")
    monkeypatch.setenv("BURNCOLL_GLOBAL_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("BURNCOLL_NODE_RANK", "3")
    assert node_rank() == 3 == burncoll.node_rank()
    assert burncoll.peer_ids(num_devices=2) == (6, 7)
    monkeypatch.setenv("BURNCOLL_NODE_RANK", "-1")
    with pytest.raises(burncoll.ConfigError, match="BURNCOLL_NODE_RANK=-1: expected"):
        node_rank()
    monkeypatch.setenv("BURNCOLL_NODE_RANK", "4")
    with pytest.raises(burncoll.ConfigError, match="BURNCOLL_NODE_RANK=4 but num_nodes=4"):
        node_rank()


def test_multi_node_peer_ids_follow_the_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURNCOLL_NODE_RANK", "1")
    multi = config(num_nodes=2, global_address="127.0.0.1:1", node_address="127.0.0.1")
    assert ddp(range(4), multi).peer_ids == (4, 5, 6, 7)
    assert ddp(range(4), multi.replace(node_rank=0)).peer_ids == (0, 1, 2, 3)


def test_nested_gradients_for_40_steps_equal_full_batch_descent() -> None:
    """The acceptance check: 4 NumPy devices, nested parameters, all_reduce_tree."""
    x, y = regression_data(n=64)
    p0 = nested_params()
    snapshots: dict[tuple[int, int], Any] = {}

    def worker(comm: burncoll.Communicator) -> Any:
        shard = len(y) // comm.world_size
        lo = comm.rank * shard
        xs, ys = x[lo : lo + shard], y[lo : lo + shard]
        p = p0
        for step in range(STEPS):
            p = nested_step(p, all_reduce_tree(comm, nested_grad(p, xs, ys)))
            snapshots[comm.rank, step] = p
        return p

    replicas = ddp(range(4), config()).run(worker)

    reference = p0
    for step in range(STEPS):
        reference = nested_step(reference, nested_grad(reference, x, y))
        for rank in range(1, 4):
            assert bitwise_equal(snapshots[rank, step], snapshots[0, step]), (rank, step)
    assert max_abs_diff(replicas[0], reference) < 1e-10
    assert max_abs_diff(reference, p0) > 1e-2  # it did train
    assert all(bitwise_equal(r, replicas[0]) for r in replicas)
    assert ddp_threads() == []


def test_a_failing_step_raises_on_all_devices_promptly_and_leaves_no_thread() -> None:
    seen: dict[int, BaseException] = {}
    lock = threading.Lock()

    def worker(comm: burncoll.Communicator) -> None:
        try:
            for step in range(10):
                if comm.rank == 2 and step == 5:
                    raise ValueError("step 5 exploded on rank 2")
                all_reduce_tree(comm, {"g": np.ones(3)})
        except BaseException as exc:
            with lock:
                seen[comm.rank] = exc
            raise

    started = time.monotonic()
    with pytest.raises(ValueError, match="step 5 exploded on rank 2"):
        ddp(range(4), config(timeout=30.0)).run(worker)
    assert time.monotonic() - started < 10.0  # released at once, not after the timeout
    assert sorted(seen) == [0, 1, 2, 3]
    for rank in (0, 1, 3):
        assert isinstance(seen[rank], burncoll.CollectiveError), seen[rank]
        assert "rank 2" in str(seen[rank]) or "peer 2" in str(seen[rank])
    assert ddp_threads() == []

    # the same config registers again afterwards
    assert ddp(range(4), config(timeout=30.0)).run(lambda comm: comm.rank) == [0, 1, 2, 3]


def test_the_first_error_is_re_raised_with_its_traceback() -> None:
    class Boom(RuntimeError):
        pass

    def worker(comm: burncoll.Communicator) -> None:
        if comm.rank == 0:
            raise Boom("rank 0 failed")
        comm.barrier()

    with pytest.raises(Boom) as info:
        ddp(range(3), config()).run(worker)
    assert any(entry.name == "worker" for entry in info.traceback)
    assert ddp_threads() == []


def test_an_error_in_every_thread_is_reported_once() -> None:
    def worker(comm: burncoll.Communicator) -> None:
        raise KeyError(comm.rank)

    with pytest.raises(KeyError):
        ddp(range(4), config()).run(worker)
    assert ddp_threads() == []


def test_a_thread_busy_outside_collectives_is_waited_for_at_most_the_timeout() -> None:
    release = threading.Event()
    stopped: list[BaseException] = []

    def worker(comm: burncoll.Communicator) -> None:
        if comm.rank == 0:
            raise LookupError("rank 0 failed")
        release.wait(10.0)  # busy in user code, not in a collective
        try:
            comm.barrier()
        except burncoll.CollectiveError as exc:
            stopped.append(exc)
            raise

    started = time.monotonic()
    with pytest.raises(LookupError) as info:
        ddp(range(2), config(num_devices=2, timeout=1.0)).run(worker)
    assert time.monotonic() - started < 5.0
    assert any("still busy" in note for note in getattr(info.value, "__notes__", []))
    release.set()
    deadline = time.monotonic() + 5.0
    while ddp_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ddp_threads() == []
    assert len(stopped) == 1 and isinstance(stopped[0], burncoll.CollectiveAborted)


def test_the_devices_given_in_the_code_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BURNCOLL_NUM_DEVICES", "2")
    assert burncoll.CollectiveConfig().num_devices == 2
    dp = ddp(range(4), burncoll.CollectiveConfig())
    assert dp.config.num_devices == 4 and len(dp.devices) == 4
