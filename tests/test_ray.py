"""burncoll.ray.run: N Ray actors as burncoll nodes, on a local Ray instance (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="burncoll.ray needs Ray: pip install 'burncoll[ray]'")

import burncoll  # noqa: E402  (after the skip: without Ray the module is skipped)
import burncoll.ray as burncoll_ray  # noqa: E402
from burncoll.train import ddp  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance takes 10-20 s to start

NDArray = np.ndarray[Any, Any]
CPUS = 4
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray_train.py"
TRAIN_ANYWHERE = EXAMPLE.with_name("train_anywhere.py")


def x_for(rank: int) -> NDArray:
    """Peer ``rank``'s input: 17 seeded float64 values."""
    return np.random.default_rng([7, rank]).normal(size=17)


def wait_until(what: str, check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0


def all_released() -> bool:
    """Every CPU free again and no placement group left but removed ones."""
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    return ray.available_resources().get("CPU") == CPUS and states <= {"REMOVED"}


# The example starts its own Ray instance: it runs before the module's (see ``local_ray``).
def test_example_trains_on_2_nodes_of_2_devices() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BURNCOLL_", "RAY_"))}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "40"],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["replicas identical"] == "yes"
    assert lines["nodes"] == "2 x 2 devices"
    assert float(lines["final loss"]) < float(lines["initial loss"])


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A lean local Ray instance with CPUS CPUs, for the whole module."""
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    try:
        yield
    finally:
        ray.shutdown()


def reduce_node() -> tuple[str, str, list[tuple[int, list[float]]]]:
    def body(comm: burncoll.Communicator) -> tuple[int, list[float]]:
        return comm.rank, comm.all_reduce(x_for(comm.rank)).tolist()

    trainer = ddp(range(2), burncoll.CollectiveConfig())
    return (os.environ["BURNCOLL_NODE_ADDRESS"], os.environ["BURNCOLL_GLOBAL_ADDRESS"],
            trainer.run(body))


def test_all_reduce_on_2_nodes_of_2_devices(local_ray: None) -> None:
    results = burncoll_ray.run(reduce_node, num_nodes=2, devices_per_node=2, timeout=60)
    want = np.sum([x_for(r) for r in range(4)], axis=0, dtype=np.float64)
    ranks = []
    for node, (address, orchestrator, peers) in enumerate(results):
        assert address == "127.0.0.1"  # one machine: everything stays on loopback
        assert orchestrator.startswith("127.0.0.1:")
        for rank, got in peers:
            ranks.append(rank)
            assert rank // 2 == node  # results come back in node-rank order
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert sorted(ranks) == [0, 1, 2, 3]
    wait_until("resources released", all_released)


def gather_node(scale: float) -> tuple[int, list[float], list[float]]:
    def body(comm: burncoll.Communicator) -> tuple[int, list[float], list[float]]:
        root = np.arange(5, dtype=np.float64) * scale if comm.rank == 1 else None
        shown = comm.broadcast(root, root=1)
        gathered = comm.all_gather(x_for(comm.rank)[: comm.rank + 1])
        return comm.rank, shown.tolist(), gathered.tolist()

    [result] = ddp(range(1), burncoll.CollectiveConfig()).run(body)
    return result


def test_broadcast_and_all_gather_on_3_nodes(local_ray: None) -> None:
    results = burncoll_ray.run(gather_node, 2.5, num_nodes=3, timeout=60)
    want_gather = np.concatenate([x_for(r)[: r + 1] for r in range(3)])
    assert [rank for rank, _, _ in results] == [0, 1, 2]
    for _, shown, gathered in results:
        np.testing.assert_array_equal(shown, np.arange(5, dtype=np.float64) * 2.5)
        np.testing.assert_array_equal(gathered, want_gather)


def regression(n: int = 64, d: int = 5) -> tuple[NDArray, NDArray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, d))
    return x, x @ rng.normal(size=d) + 0.1 * rng.normal(size=n)


def linear_loss_and_grad(
    params: dict[str, NDArray], batch: tuple[NDArray, NDArray]
) -> tuple[float, dict[str, NDArray]]:
    x, y = batch
    err = x @ params["w"] + params["b"][0] - y
    grads = {"w": 2.0 * x.T @ err / len(y), "b": np.array([2.0 * err.mean()])}
    return float(np.mean(err**2)), grads


def step(params: dict[str, NDArray], grads: dict[str, NDArray]) -> dict[str, NDArray]:
    return {k: params[k] - 0.05 * grads[k] for k in params}


def fit_node(steps: int) -> tuple[dict[str, NDArray], list[float], bool]:
    trainer = ddp(range(2), burncoll.CollectiveConfig())
    start = {"w": np.zeros(5), "b": np.zeros(1)}
    result = trainer.fit(start, regression(), linear_loss_and_grad, step, steps=steps,
                         progress=False)
    return result.params, result.losses, result.identical


def test_fit_equals_single_process_fit_and_plain_descent(local_ray: None) -> None:
    steps = 25
    results = burncoll_ray.run(fit_node, steps, num_nodes=2, devices_per_node=2, timeout=60)
    local = ddp(range(4), burncoll.CollectiveConfig(num_devices=4)).fit(
        {"w": np.zeros(5), "b": np.zeros(1)}, regression(), linear_loss_and_grad, step,
        steps=steps, progress=False)
    x, y = regression()
    params = {"w": np.zeros(5), "b": np.zeros(1)}
    losses = []
    for _ in range(steps):  # the independent reference: full-batch descent, float64
        loss, grads = linear_loss_and_grad(params, (x, y))
        losses.append(loss)
        params = step(params, grads)
    for got, got_losses, identical in results:
        assert identical
        for k in params:
            np.testing.assert_allclose(got[k], local.params[k], rtol=0, atol=1e-12)
            np.testing.assert_allclose(got[k], params[k], rtol=0, atol=1e-10)
        np.testing.assert_allclose(got_losses, losses, rtol=0, atol=1e-10)
    assert losses[-1] < losses[0]


def failing_node(pid_dir: str) -> None:
    Path(pid_dir, os.environ["BURNCOLL_NODE_RANK"]).write_text(str(os.getpid()))

    def body(comm: burncoll.Communicator) -> None:
        comm.all_reduce(np.ones(3))
        if comm.rank == 2:
            raise ValueError("bad batch on peer 2")
        comm.all_reduce(np.ones(3))

    ddp(range(2), burncoll.CollectiveConfig(timeout=10)).run(body)


def test_failure_on_node_1_is_raised_and_everything_is_released(
    local_ray: None, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="bad batch on peer 2") as raised:
        burncoll_ray.run(failing_node, str(tmp_path), num_nodes=2, devices_per_node=2,
                         timeout=60)
    assert any("node 1 of 2" in note for note in raised.value.__notes__)
    assert isinstance(raised.value.__cause__, ray.exceptions.RayTaskError)
    pids = [int(p.read_text()) for p in sorted(tmp_path.iterdir())]
    assert len(pids) == 2
    wait_until("actor processes gone", lambda: all(process_gone(p) for p in pids))
    wait_until("resources released", all_released)


def test_a_node_that_fails_before_its_collective_is_reported_at_once(local_ray: None) -> None:
    def early() -> None:
        if os.environ["BURNCOLL_NODE_RANK"] == "1":
            raise burncoll.ConfigError("node 1 has no data")
        ddp(range(1), burncoll.CollectiveConfig(timeout=300)).run(lambda comm: None)

    # node 0 would wait 300 s for node 1 to register; run raises node 1's error and kills it
    with pytest.raises(burncoll.ConfigError, match="node 1 has no data"):
        burncoll_ray.run(early, num_nodes=2, timeout=60)
    wait_until("resources released", all_released)


def test_a_cluster_too_small_is_a_timeout_naming_the_placement(local_ray: None) -> None:
    with pytest.raises(burncoll.CollectiveTimeout, match="could not place 5 node"):
        burncoll_ray.run(print, num_nodes=5, timeout=2)
    with pytest.raises(burncoll.CollectiveTimeout, match=r"'GPU': 1\.0"):  # no GPU here
        burncoll_ray.run(print, num_nodes=1, num_gpus_per_node=1, timeout=2)
    wait_until("resources released", all_released)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_nodes": 0}, "num_nodes=0"),
        ({"num_nodes": 2, "devices_per_node": 0}, "devices_per_node=0"),
        ({"num_nodes": True}, "num_nodes=True"),
        ({"num_nodes": 2, "timeout": 0}, "timeout=0"),
        ({"num_nodes": 2, "num_cpus_per_node": -1}, "num_cpus_per_node=-1"),
        ({"num_nodes": 2, "transport": "carrier-pigeon"}, "transport='carrier-pigeon'"),
        ({"num_nodes": 2, "env": {"BURNCOLL_NODE_RANK": "1"}}, "BURNCOLL_NODE_RANK"),
    ],
)
def test_bad_arguments_are_usage_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(burncoll.UsageError, match=match):
        burncoll_ray.run(print, **kwargs)


def train_anywhere_node(argv: list[str]) -> dict[str, Any]:
    """examples/train_anywhere.py's own ``main``, unchanged, as one Ray node; its result file."""
    import importlib.util
    import json
    import tempfile

    spec = importlib.util.spec_from_file_location("train_anywhere", TRAIN_ANYWHERE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "r.json"
        module.main([*argv, "--result", str(result)])
        loaded: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    return loaded


def test_the_same_training_script_runs_on_ray(local_ray: None) -> None:
    """The script every launcher runs (examples/train_anywhere.py) on 2 Ray nodes of 2
    devices: node 0's final parameters equal single-process float64 descent."""
    from tests.launchers.common import reference

    results = burncoll_ray.run(train_anywhere_node, ["--steps", "20"], num_nodes=2,
                               devices_per_node=2, timeout=60)
    state = results[0]
    assert results[1] == {}  # only node 0 writes the result
    assert state["nodes"] == 2 and state["devices"] == 2 and state["identical"]
    for name, value in reference(20).items():
        np.testing.assert_allclose(np.asarray(state["params"][name]), value, rtol=1e-9,
                                   atol=1e-12)
