"""Elastic restarts: a node killed mid-training, restarted by ``burncoll launch
--max-restarts``, resumes from its checkpoint and ends like an undisturbed run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launchers.common import CRASHING, EXAMPLE, assert_trained, clean_env, read_result, run

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
