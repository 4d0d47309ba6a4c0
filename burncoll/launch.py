"""``burncoll launch``: an orchestrator and N node processes of a script, on this machine.

Like ``torchrun --standalone``: each node gets its node rank, the orchestrator's address and
its own settings through ``BURNCOLL_*`` environment variables, which ``CollectiveConfig``
reads. Each node's output is prefixed with ``[node R]``. The exit code is the first failing
node's; once a node fails, the others get ``grace`` seconds to finish before they are stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from burncoll.orchestrator import start_orchestrator

__all__ = ["launch_nodes", "node_environment"]


def node_environment(
    rank: int, nodes: int, devices: int, orchestrator: str, transport: str,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of node ``rank``: the parent's plus the BURNCOLL_* settings."""
    env = dict(os.environ)
    env.update({
        "BURNCOLL_NODE_RANK": str(rank),
        "BURNCOLL_NUM_NODES": str(nodes),
        "BURNCOLL_NUM_DEVICES": str(devices),
        "BURNCOLL_GLOBAL_ADDRESS": orchestrator,
        "BURNCOLL_NODE_ADDRESS": "127.0.0.1",
        "BURNCOLL_DATA_SERVICE_PORT": "0",
        "BURNCOLL_TRANSPORT": transport,
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def _pump(rank: int, stream: IO[str], sink: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            sink.write(f"[node {rank}] {line}")
            sink.flush()


def launch_nodes(
    command: Sequence[str],
    nodes: int,
    devices: int,
    transport: str = "websocket",
    auth_token: str | None = None,
    grace: float = 30.0,
    extra_env: dict[str, str] | None = None,
) -> int:
    """Run ``command`` as ``nodes`` node processes around a fresh orchestrator.

    Returns 0 when every node exits 0, else the exit code of the first node that failed.
    """
    extra = dict(extra_env or {})
    if auth_token is not None:
        extra["BURNCOLL_AUTH_TOKEN"] = auth_token
    with start_orchestrator(transport=transport, auth_token=auth_token) as orchestrator:
        lock = threading.Lock()
        procs: list[subprocess.Popen[str]] = []
        pumps: list[threading.Thread] = []
        for rank in range(nodes):
            env = node_environment(rank, nodes, devices, orchestrator.address, transport, extra)
            proc = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1,
            )
            procs.append(proc)
            if proc.stdout is not None:
                pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout, lock),
                                        daemon=True)
                pump.start()
                pumps.append(pump)
        code = _wait_all(procs, grace)
        for pump in pumps:
            pump.join(5)
        return code


def _wait_all(procs: list[subprocess.Popen[str]], grace: float) -> int:
    first_failure: int | None = None
    failed_at: float | None = None
    while True:
        running = False
        for proc in procs:
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 and first_failure is None:
                first_failure, failed_at = code, time.monotonic()
        if not running:
            break
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.05)
    return first_failure or 0
