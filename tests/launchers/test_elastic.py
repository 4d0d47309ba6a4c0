"""Elastic restarts: a node killed mid-training, restarted by ``burncoll launch
--max-restarts``, resumes from its checkpoint and ends like an undisturbed run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launchers.common import (
    CRASHING,
    EXAMPLE,
    REPO,
    assert_trained,
    clean_env,
    read_result,
    run,
)

pytestmark = pytest.mark.slow


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_a_killed_node_restarts_and_ends_like_an_undisturbed_run(tmp_path: Path) -> None:
    """Elastic: node 1 dies by SIGKILL after step 12 of 30; ``--max-restarts 1`` starts both
    nodes again, they resume from the step-10 checkpoint, and the final parameters equal
    those of a run nobody disturbed."""
    steps = 30
    launch = [sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2",
              "--max-restarts", "1"]
    killed, calm = tmp_path / "killed.json", tmp_path / "calm.json"
    proc = run([*launch, str(CRASHING), "--devices", "1", "--steps", str(steps),
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5",
                "--result", str(killed)],
               clean_env(CRASH_NODE="1", CRASH_STEP="12"), timeout=180)
    _ok(proc)
    assert "dies after step 12" in proc.stdout, proc.stdout
    assert "restart 1 of 1" in proc.stderr, proc.stderr
    proc = run([*launch, str(EXAMPLE), "--devices", "1", "--steps", str(steps),
                "--result", str(calm)], clean_env(), timeout=180)
    _ok(proc)
    resumed, undisturbed = read_result(killed), read_result(calm)
    assert resumed["losses"] == undisturbed["losses"]
    for name, value in undisturbed["params"].items():
        assert np.array_equal(resumed["params"][name], value), name
    assert_trained(killed, steps, nodes=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_lost_host_is_dropped_and_the_others_go_on_with_fewer_nodes(tmp_path: Path) -> None:
    """``--min-nodes 2`` of 3: host 2 dies with its launcher after step 12; hosts 0 and 1
    restart, wait 2 s for host 2, then resume from the checkpoint as 2 nodes and finish;
    the parameters equal single-process descent (only the sharding changed)."""
    steps, port = 30, _free_port()
    result = tmp_path / "r.json"
    launchers = []
    for rank in range(3):
        argv = [sys.executable, "-m", "burncoll.cli", "launch", "--nnodes", "3", "--node-rank",
                str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--max-restarts", "1", "--min-nodes", "2", "--min-nodes-wait", "2",
                str(CRASHING), "--devices", "1", "--steps", str(steps), "--checkpoint-dir",
                str(tmp_path / "ckpt"), "--checkpoint-every", "5", "--result", str(result)]
        env = clean_env(CRASH_NODE="2", CRASH_STEP="12", CRASH_HOST="1")
        launchers.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=150)[0] for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    codes = [p.returncode for p in launchers]
    assert codes[:2] == [0, 0] and codes[2] == -signal.SIGKILL, (codes, outputs)
    assert all("restart 1 of 1" in out for out in outputs[:2]), outputs
    assert "2 of 3 nodes joined" in outputs[0], outputs[0]  # node 0's launcher hosts it
    state = assert_trained(result, steps, nodes=2)
    assert len(state["losses"]) == steps
