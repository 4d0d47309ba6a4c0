"""A user's exception on one node ends every node's run at once, not at the timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launchers.common import clean_env, run

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "raising_worker.py"


def test_an_exception_in_one_peer_ends_both_nodes_without_waiting_for_the_timeout() -> None:
    # the collective timeout is 120 s: run() would raise subprocess.TimeoutExpired at 60 s
    # if the node of the failing peer waited for a finish the other node never sends
    proc = run([sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2", "--devices",
                "2", str(WORKER)], clean_env(), timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "node 1 ended with ValueError: peer 2 gives up" in proc.stdout, proc.stdout
    assert "node 0 ended with" in proc.stdout and "peer 2 gives up" in proc.stdout
