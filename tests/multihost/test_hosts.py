"""burncoll across several real hosts: network namespaces joined by a bridge (see netns.py).

Each host has its own network stack and one 10.x address; nothing but its /24 is reachable.
So a node that binds loopback, advertises an address only it can reach, or reads the wrong
rendezvous address fails here, where it would pass with every process on 127.0.0.1. Each
test checks the collective's result against a float64 NumPy reference (exact: the worker's
values add up without rounding) and, for training, against an undisturbed run bit for bit.
Needs root (``ip netns add``); skipped otherwise.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.launchers.common import CRASHING, EXAMPLE, assert_trained, clean_env, read_result
from tests.multihost.netns import Host, hosts
from tests.multihost.worker import MARK, contribution

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("worker.py")
LAUNCH = [sys.executable, "-m", "burncoll.cli", "launch"]
#: Every host has its own ports, so a fixed one can't clash with anything outside.
PORT = 29400
#: Seconds all processes of one run get, together.
TIMEOUT = 110.0


@dataclass
class Ran:
    """One host's process of a run: its exit code and its output (stdout and stderr)."""

    host: Host
    code: int
    output: str


def _run_on(hosts_: Sequence[Host], argvs: Sequence[list[str]], envs: Sequence[dict[str, str]],
            logs: Path, timeout: float = TIMEOUT) -> list[Ran]:
    """Start ``argvs[i]`` on ``hosts_[i]`` all at once and wait for every one (killed past
    ``timeout`` seconds, which fails the test with their output)."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"{host.name}.log" for host in hosts_]
    procs = []
    for host, argv, env, path in zip(hosts_, argvs, envs, paths, strict=True):
        with path.open("w") as sink:
            procs.append(host.popen(argv, env, stdout=sink, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        shown = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in paths)
        pytest.fail(f"the run did not end within {timeout:g} s:\n{shown}")
    return [Ran(h, c, p.read_text()) for h, c, p in zip(hosts_, codes, paths, strict=True)]


def _ok(runs: Sequence[Ran]) -> None:
    bad = [r for r in runs if r.code != 0]
    assert not bad, "\n".join(f"--- {r.host.name} exited {r.code}\n{r.output}" for r in runs)


def _reports(output: str, kind: str) -> list[dict[str, Any]]:
    """The worker's ``MULTIHOST`` JSON lines of ``kind`` (a launcher prefixes ``[node R]``)."""
    found = [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]
    return [r for r in found if r["kind"] == kind]


def _check_reduced(runs: Sequence[Ran], devices: int, rendezvous: str) -> None:
    """Each host's node knew its rank, its own 10.x address and the rendezvous, and every
    peer got the exact float64 sum of every peer's contribution."""
    _ok(runs)
    nodes = len(runs)
    world = list(range(nodes * devices))
    expected = np.sum(np.stack([contribution(p) for p in world]), axis=0, dtype=np.float64)
    for rank, run in enumerate(runs):
        (config,) = _reports(run.output, "config")
        assert (config["node_rank"], config["num_nodes"]) == (rank, nodes), run.output
        assert config["node_address"] == run.host.address, (config, run.host)
        assert config["global_address"] == rendezvous, config
        (result,) = _reports(run.output, "result")
        assert result["node_rank"] == rank
        peers = result["results"]
        assert [p["peer_id"] for p in peers] == [rank * devices + d for d in range(devices)]
        for peer in peers:
            assert peer["world"] == world and peer["dtype"] == "float64", peer["world"]
            got = np.asarray(peer["sum"], dtype=np.float64)
            assert np.array_equal(got, expected), (
                f"peer {peer['peer_id']}: {np.count_nonzero(got != expected)} of "
                f"{expected.size} elements differ from the float64 reference")


def _launch_argv(h0: Host, host: Host, nnodes: int, port: int, *more: str) -> list[str]:
    """``burncoll launch --nnodes ... --node-rank host.index ...`` then ``more``."""
    return [*LAUNCH, "--nnodes", str(nnodes), "--node-rank", str(host.index),
            "--master-addr", h0.address, "--master-port", str(port), *more]


def test_burncoll_launch_on_two_hosts(tmp_path: Path) -> None:
    """``burncoll launch --nnodes 2`` once per host, a shared token: each node advertises its
    own host's address, and both nodes of 2 devices all-reduce exactly."""
    env = clean_env(BURNCOLL_AUTH_TOKEN=secrets.token_urlsafe(32))
    with hosts(2) as hs:
        argvs = [_launch_argv(hs[0], h, 2, PORT, "--devices", "2", str(WORKER)) for h in hs]
        runs = _run_on(hs, argvs, [env, env], tmp_path)
        _check_reduced(runs, devices=2, rendezvous=f"{hs[0].address}:{PORT}")


@pytest.mark.parametrize("nodes", [2, 3])
def test_torchrun_variables_on_several_hosts(tmp_path: Path, nodes: int) -> None:
    """Plain ``python worker.py`` per host with torchrun's variables: node 0 hosts the
    rendezvous in its own process on MASTER_PORT + 1, the others find it there, and each
    node's address is the one routing to MASTER_ADDR (its own host's)."""
    token = secrets.token_urlsafe(32)
    with hosts(nodes) as hs:
        envs = [clean_env(RANK=str(h.index), WORLD_SIZE=str(nodes), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1", GROUP_RANK=str(h.index),
                          MASTER_ADDR=hs[0].address, MASTER_PORT=str(PORT),
                          BURNCOLL_AUTH_TOKEN=token) for h in hs]
        runs = _run_on(hs, [[sys.executable, str(WORKER)] for _ in hs], envs, tmp_path)
        _check_reduced(runs, devices=1, rendezvous=f"{hs[0].address}:{PORT + 1}")
        configs = [_reports(r.output, "config")[0] for r in runs]
        assert [c["host_orchestrator"] for c in configs] == [True] + [False] * (nodes - 1)


def test_a_killed_node_restarts_across_hosts(tmp_path: Path) -> None:
    """Node 1 (on host 1) dies by SIGKILL after step 12 of 30; both hosts' launchers
    (``--max-restarts 1``) start their nodes again, which resume from the step-10 checkpoint
    and end with the parameters and losses of an undisturbed 2-host run, bit for bit."""
    steps = ["--devices", "1", "--steps", "30"]
    killed, calm = tmp_path / "killed.json", tmp_path / "calm.json"
    token = secrets.token_urlsafe(32)
    with hosts(2) as hs:
        crash_env = clean_env(BURNCOLL_AUTH_TOKEN=token, CRASH_NODE="1", CRASH_STEP="12")
        argvs = [_launch_argv(hs[0], h, 2, PORT, "--max-restarts", "1", str(CRASHING), *steps,
                              "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--checkpoint-every", "5", "--result", str(killed)) for h in hs]
        runs = _run_on(hs, argvs, [crash_env, crash_env], tmp_path / "crash")
        _ok(runs)
        assert "dies after step 12" in runs[1].output, runs[1].output
        for run in runs:
            assert "restart 1 of 1" in run.output, run.output
        env = clean_env(BURNCOLL_AUTH_TOKEN=token)
        argvs = [_launch_argv(hs[0], h, 2, PORT + 10, str(EXAMPLE), *steps,
                              "--result", str(calm)) for h in hs]
        _ok(_run_on(hs, argvs, [env, env], tmp_path / "calm"))
    resumed, undisturbed = read_result(killed), read_result(calm)
    assert resumed["losses"] == undisturbed["losses"]
    for name, value in undisturbed["params"].items():
        assert np.array_equal(resumed["params"][name], value), name
    assert_trained(killed, 30, nodes=2)


def test_real_torchrun_on_two_hosts(tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --node-rank R --master-addr H0`` once per host (its static
    rendezvous on MASTER_PORT, burncoll's on MASTER_PORT + 1)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        found = shutil.which("torchrun")
        if found is None:
            pytest.skip("torchrun is not installed (it comes with torch, the [bench] extra)")
        torchrun = Path(found)
    env = clean_env(BURNCOLL_AUTH_TOKEN=secrets.token_urlsafe(32), OMP_NUM_THREADS="1")
    with hosts(2) as hs:
        argvs = [[str(torchrun), "--nnodes", "2", "--node-rank", str(h.index),
                  "--master-addr", hs[0].address, "--master-port", str(PORT),
                  "--nproc-per-node", "1", str(WORKER)] for h in hs]
        runs = _run_on(hs, argvs, [env, env], tmp_path)
        _check_reduced(runs, devices=1, rendezvous=f"{hs[0].address}:{PORT + 1}")


def test_a_lost_host_is_dropped_with_min_nodes(tmp_path: Path) -> None:
    """Three hosts, ``--min-nodes 2``: host 2 is lost (its node and its launcher die) after
    step 12 of 30; hosts 0 and 1 restart, wait 2 s more for it, then go on as 2 nodes from
    the step-10 checkpoint, and the final parameters equal single-process descent."""
    result = tmp_path / "r.json"
    env = clean_env(BURNCOLL_AUTH_TOKEN=secrets.token_urlsafe(32), CRASH_NODE="2",
                    CRASH_STEP="12", CRASH_HOST="1")
    with hosts(3) as hs:
        argvs = [_launch_argv(hs[0], h, 3, PORT, "--max-restarts", "1", "--min-nodes", "2",
                              "--min-nodes-wait", "2", str(CRASHING), "--devices", "1",
                              "--steps", "30", "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--checkpoint-every", "5", "--result", str(result))
                 for h in hs]
        runs = _run_on(hs, argvs, [env] * 3, tmp_path / "logs")
    _ok(runs[:2])
    assert runs[2].code != 0  # its launcher was killed with it
    assert "2 of 3 nodes joined" in runs[0].output, runs[0].output
    assert len(assert_trained(result, 30, nodes=2)["losses"]) == 30
