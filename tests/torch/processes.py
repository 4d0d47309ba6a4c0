"""Run a worker script of tests/torch as N real processes (one torch rank each) and collect
the JSON lines they print."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: Seconds a whole run of worker processes may take (imports of torch on a busy machine).
RUN_SECONDS = 150


def environment(**extra: str) -> dict[str, str]:
    """This environment with the worktree on ``PYTHONPATH``, no launcher variables left over
    from whoever runs the tests, and ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BURNCOLL_", "SLURM_", "OMPI_", "PMI"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def free_port() -> int:
    """A port free on loopback now (for torch's TCPStore, which the rank 0 process binds)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_ranks(script: str, size: int, *args: str, envs: list[dict[str, str]] | None = None,
              ) -> list[tuple[int, list[dict[str, Any]], str]]:
    """Run ``script RANK SIZE *args`` as ``size`` processes; per rank: (exit status, its JSON
    records, the end of its stderr)."""
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / script), str(rank), str(size), *args],
        env=envs[rank] if envs else environment(), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE) for rank in range(size)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=RUN_SECONDS)
            results.append((proc.returncode, records(out), err[-3000:]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
