"""The CLI's multi-node commands, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_demo_across_two_node_processes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "burncoll.cli", "demo", "--nodes", "2", "--devices", "2",
         "--steps", "50"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[node 0] replicas identical: yes" in done.stdout


def test_launch_runs_an_example_on_every_node_and_prefixes_output() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2", "--devices", "2",
         str(EXAMPLES / "ddp_numpy.py")], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[node 0] replicas identical: yes" in done.stdout


def test_launch_exits_with_the_failing_nodes_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['BURNCOLL_NODE_RANK'] == '1' "
                      "else 0)\n")
    done = subprocess.run(
        [sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2", str(script)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
