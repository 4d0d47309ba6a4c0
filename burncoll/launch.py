"""``burncoll launch``: an orchestrator and N node processes of a script, on this machine.

Like ``torchrun --standalone``: each node gets its node rank, the orchestrator's address and
its own settings through ``BURNCOLL_*`` environment variables, which ``CollectiveConfig``
reads. Each node's output is prefixed with ``[node R]``. The exit code is the first failing
node's; once a node fails, the others get ``grace`` seconds to finish before they are stopped.

Everything binds loopback, and the run is authenticated all the same: without a token given,
a fresh random one (:func:`secrets.token_urlsafe`, 32 bytes) is made for the run and handed
to the orchestrator and to the nodes through their environment (never their argv, which
every user can read in ``/proc/PID/cmdline``). The orchestrator accepts only registrations of
``nodes`` nodes.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from burncoll.orchestrator import start_orchestrator

__all__ = ["launch_nodes", "new_token", "node_environment"]


def new_token() -> str:
    """A fresh random token for one run: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


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


def _security_environment(token: str, integrity: bool, tls: bool | None) -> dict[str, str]:
    """The settings every node must share with the orchestrator, as environment variables."""
    return {
        "BURNCOLL_AUTH_TOKEN": token,
        "BURNCOLL_INTEGRITY": "1" if integrity else "0",
        "BURNCOLL_TLS": "auto" if tls is None else ("1" if tls else "0"),
    }


def launch_nodes(
    command: Sequence[str],
    nodes: int,
    devices: int,
    transport: str = "websocket",
    auth_token: str | None = None,
    grace: float = 30.0,
    extra_env: dict[str, str] | None = None,
    *,
    integrity: bool = False,
    tls: bool | None = None,
) -> int:
    """Run ``command`` as ``nodes`` node processes around a fresh orchestrator.

    ``auth_token``: the run's token; ``None`` makes a fresh random one (:func:`new_token`).
    It reaches the nodes as ``BURNCOLL_AUTH_TOKEN`` (``BURNCOLL_AUTH_TOKEN_FILE`` is removed
    from their environment, the token having been read already). ``integrity``, ``tls``: as
    the config fields, set on the orchestrator and on every node. Returns 0 when every node
    exits 0, else the exit code of the first node that failed.
    """
    token = new_token() if auth_token is None else auth_token
    extra = dict(extra_env or {})
    extra.update(_security_environment(token, integrity, tls))
    with start_orchestrator(transport=transport, auth_token=token, integrity=integrity,
                            tls=tls, expected_nodes=nodes) as orchestrator:
        lock = threading.Lock()
        procs: list[subprocess.Popen[str]] = []
        pumps: list[threading.Thread] = []
        for rank in range(nodes):
            env = node_environment(rank, nodes, devices, orchestrator.address, transport, extra)
            env.pop("BURNCOLL_AUTH_TOKEN_FILE", None)
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
