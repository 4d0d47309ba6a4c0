"""``burncoll launch``: node processes of a script, on one machine or one per host, restarted.

Two forms, with torchrun's vocabulary:

* :func:`launch_nodes` (``burncoll launch --nodes N``), like ``torchrun --standalone``: an
  orchestrator and N node processes on this machine. Everything binds loopback, and the run
  is authenticated all the same: without a token given, a fresh random one
  (:func:`secrets.token_urlsafe`, 32 bytes) is made for the run.
* :func:`launch_host` (``burncoll launch --nnodes N --node-rank R --master-addr HOST
  --master-port PORT``), run once per host: this host runs node R of N. The launcher of node 0
  hosts the orchestrator on ``HOST:PORT`` for the whole run, restarts included. Every host must
  share the token, so none is made up: it comes from ``BURNCOLL_AUTH_TOKEN`` or a token file,
  and a non-loopback ``HOST`` without one is an error. A loopback ``HOST`` without a token runs
  unauthenticated (only this machine can reach it), as the orchestrator allows.

Each node gets its node rank, the orchestrator's address and its own settings through
``BURNCOLL_*`` environment variables, which ``CollectiveConfig`` reads; the token travels
through the environment too (never argv, which every user can read in
``/proc/PID/cmdline``). Each node's output is prefixed with ``[node R]``.

Failures and restarts (``max_restarts``): when a node of this launcher exits non-zero or is
killed by a signal and restarts remain, the launcher stops its other nodes (SIGTERM, then
SIGKILL after :data:`STOP_SECONDS`) and starts all of them again, ``BURNCOLL_RESTART_COUNT``
one higher (0 the first time). The orchestrator keeps running: the restarted nodes register
again and form a new session. Nodes on other hosts see the lost node as a
:class:`~burncoll.PeerLost` error, exit non-zero, and their own launchers restart them. In the
last round (no restart left) the other nodes get ``grace`` seconds to finish before they are
stopped. The exit code is 0 when the last round succeeds, else the first failing node's code
in it (a death by signal N gives 128 + N, as in shells).

Limits: a node that finished its work before a peer died is not restarted (its launcher has
exited 0), so a script whose nodes can finish at different points should end with a
collective (as :meth:`~burncoll.Communicator.finish` is), which fails when a peer is lost.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from burncoll.config.addresses import route_address
from burncoll.config.security import check_token, is_loopback
from burncoll.errors import ConfigError
from burncoll.orchestrator import start_orchestrator

__all__ = [
    "RESTART_COUNT_ENV",
    "STOP_SECONDS",
    "exit_code",
    "launch_host",
    "launch_nodes",
    "new_token",
    "node_environment",
]

#: The environment variable telling a node how many times its launcher restarted it.
RESTART_COUNT_ENV = "BURNCOLL_RESTART_COUNT"
#: Seconds a node has to exit after SIGTERM before it gets SIGKILL.
STOP_SECONDS = 5.0
#: Seconds between two looks at the node processes.
_POLL_SECONDS = 0.05

#: Environments of one round, by node rank; called with the restart count.
EnvsFor = Callable[[int], dict[int, dict[str, str]]]


def new_token() -> str:
    """A fresh random token for one run: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def node_environment(
    rank: int, nodes: int, devices: int, orchestrator: str, transport: str,
    extra: dict[str, str] | None = None, *, node_address: str = "127.0.0.1", restart: int = 0,
) -> dict[str, str]:
    """The environment of node ``rank``: the parent's plus the BURNCOLL_* settings.

    ``node_address``: where its data service listens (other nodes connect there);
    ``restart``: its ``BURNCOLL_RESTART_COUNT``.
    """
    env = dict(os.environ)
    env.update({
        "BURNCOLL_NODE_RANK": str(rank),
        "BURNCOLL_NUM_NODES": str(nodes),
        "BURNCOLL_NUM_DEVICES": str(devices),
        "BURNCOLL_GLOBAL_ADDRESS": orchestrator,
        "BURNCOLL_NODE_ADDRESS": node_address,
        "BURNCOLL_DATA_SERVICE_PORT": "0",
        "BURNCOLL_TRANSPORT": transport,
        RESTART_COUNT_ENV: str(restart),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    """``"3"``, or ``"-9 (SIGKILL)"`` for a death by signal."""
    if returncode >= 0:
        return str(returncode)
    try:
        return f"{returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return str(returncode)


def _pump(rank: int, stream: IO[str], sink: IO[str], lock: threading.Lock) -> None:
    """Copy a node's output line by line, prefixed. A node killed mid-line leaves a last line
    without its newline: it gets one, so the next node's line is not glued to it."""
    for line in stream:
        with lock:
            sink.write(f"[node {rank}] {line if line.endswith(chr(10)) else line + chr(10)}")
            sink.flush()


def _security_environment(token: str | None, integrity: bool, tls: bool | None
                          ) -> dict[str, str]:
    """The settings every node must share with the orchestrator, as environment variables."""
    env = {
        "BURNCOLL_INTEGRITY": "1" if integrity else "0",
        "BURNCOLL_TLS": "auto" if tls is None else ("1" if tls else "0"),
    }
    if token is not None:
        env["BURNCOLL_AUTH_TOKEN"] = token
    return env


def _node_env(base: dict[str, str], token: str | None) -> dict[str, str]:
    """``base`` without the token file (the token was read already), nor a token when the
    run has none."""
    env = dict(base)
    env.pop("BURNCOLL_AUTH_TOKEN_FILE", None)
    if token is None:
        env.pop("BURNCOLL_AUTH_TOKEN", None)
    return env


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
    max_restarts: int = 0,
) -> int:
    """Run ``command`` as ``nodes`` node processes around a fresh orchestrator.

    ``auth_token``: the run's token; ``None`` makes a fresh random one (:func:`new_token`).
    It reaches the nodes as ``BURNCOLL_AUTH_TOKEN`` (``BURNCOLL_AUTH_TOKEN_FILE`` is removed
    from their environment, the token having been read already). ``integrity``, ``tls``: as
    the config fields, set on the orchestrator and on every node. ``max_restarts``: how many
    times every node is restarted after one fails (see the module). Returns 0 when every node
    of the last round exits 0, else the exit code of the first node that failed in it.
    """
    _check_restarts(max_restarts)
    token = new_token() if auth_token is None else auth_token
    extra = dict(extra_env or {})
    extra.update(_security_environment(token, integrity, tls))
    with start_orchestrator(transport=transport, auth_token=token, integrity=integrity,
                            tls=tls, expected_nodes=nodes) as orchestrator:

        def envs_for(restart: int) -> dict[int, dict[str, str]]:
            return {rank: _node_env(node_environment(rank, nodes, devices, orchestrator.address,
                                                     transport, extra, restart=restart), token)
                    for rank in range(nodes)}

        return _run_rounds(command, envs_for, max_restarts, grace)


def launch_host(
    command: Sequence[str],
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    devices: int,
    transport: str = "websocket",
    auth_token: str | None = None,
    grace: float = 30.0,
    extra_env: dict[str, str] | None = None,
    *,
    integrity: bool = False,
    tls: bool | None = None,
    max_restarts: int = 0,
    node_address: str | None = None,
    min_nodes: int | None = None,
    min_nodes_wait: float = 30.0,
) -> int:
    """Run node ``node_rank`` of ``nnodes`` (one per host) of ``command`` on this host.

    Call it once on every host with the same ``nnodes``, ``master_addr``, ``master_port``,
    ``devices``, token and modes. With ``node_rank == 0`` it also runs the orchestrator on
    ``master_addr:master_port`` until it returns. ``auth_token``: shared by every host;
    ``None`` runs without authentication, which only a loopback ``master_addr`` allows
    (:class:`~burncoll.ConfigError` otherwise, before anything connects). ``node_address``:
    where this node's data service listens, for the other hosts to reach; default the address
    of the interface that routes to ``master_addr``. ``max_restarts``, ``grace`` and the
    result: as :func:`launch_nodes`. ``min_nodes`` (elastic, given to node 0's launcher): a
    session forms with fewer nodes, at least ``min_nodes``, when the missing ones have not
    joined ``min_nodes_wait`` seconds after the ``min_nodes``-th did (a host that died does
    not come back; the others restart and go on without it).
    """
    _check_host(nnodes, node_rank, master_addr, master_port, devices)
    _check_restarts(max_restarts)
    host = master_addr.strip().strip("[]")
    if auth_token is None and not is_loopback(host):
        raise ConfigError(missing_token_message(master_addr))
    check_token(auth_token, "the launch's auth token")
    address = node_address or route_address(host)
    orchestrator = f"[{host}]:{master_port}" if ":" in host else f"{host}:{master_port}"
    extra = dict(extra_env or {})
    extra.update(_security_environment(auth_token, integrity, tls))

    def envs_for(restart: int) -> dict[int, dict[str, str]]:
        env = node_environment(node_rank, nnodes, devices, orchestrator, transport, extra,
                               node_address=address, restart=restart)
        return {node_rank: _node_env(env, auth_token)}

    if node_rank != 0:
        return _run_rounds(command, envs_for, max_restarts, grace)
    with start_orchestrator(host, master_port, transport, auth_token, integrity=integrity,
                            tls=tls, expected_nodes=nnodes, min_nodes=min_nodes,
                            min_nodes_wait=min_nodes_wait):
        return _run_rounds(command, envs_for, max_restarts, grace)


def missing_token_message(master_addr: str) -> str:
    """Why a multi-host launch with a non-loopback master needs a token, and how to give it."""
    return (
        f"--master-addr {master_addr!r} is reachable from other machines, and no auth token is "
        "set: every host must hold the same token (a fresh random one would differ from host "
        "to host). Export the same BURNCOLL_AUTH_TOKEN=<secret> on every host, or copy a "
        "token file to every host and give it with --auth-token-file PATH (or "
        "BURNCOLL_AUTH_TOKEN_FILE=PATH); make a token with: python -c 'import secrets; "
        "print(secrets.token_urlsafe(32))'"
    )


def _is_count(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_restarts(max_restarts: int) -> None:
    if not _is_count(max_restarts, 0):
        raise ConfigError(f"max_restarts={max_restarts!r}: expected an int >= 0")


def _check_host(nnodes: int, node_rank: int, master_addr: str, master_port: int,
                devices: int) -> None:
    """:class:`ConfigError` for arguments of :func:`launch_host` that cannot work."""
    if not _is_count(nnodes, 1):
        raise ConfigError(f"nnodes={nnodes!r}: expected an int >= 1 (the number of hosts)")
    if not _is_count(node_rank, 0) or node_rank >= nnodes:
        raise ConfigError(f"node_rank={node_rank!r}: expected an int in [0, {nnodes}) "
                          f"(nnodes={nnodes}); give each host its own rank")
    if not isinstance(master_addr, str) or not master_addr.strip().strip("[]"):
        raise ConfigError(f"master_addr={master_addr!r}: expected the host name or address "
                          "of the node-rank-0 host")
    if not _is_count(master_port, 1) or master_port > 65535:
        raise ConfigError(f"master_port={master_port!r}: expected a port in [1, 65535], the "
                          "same on every host")
    if not _is_count(devices, 1):
        raise ConfigError(f"devices={devices!r}: expected an int >= 1")


def _run_rounds(command: Sequence[str], envs_for: EnvsFor, max_restarts: int,
                grace: float) -> int:
    """Run rounds of the node processes until one succeeds or no restart remains."""
    for restart in range(max_restarts + 1):
        last = restart == max_restarts
        failure = _run_round(command, envs_for(restart), grace if last else 0.0)
        if failure is None:
            return 0
        rank, code = failure
        if last:
            if max_restarts:
                _say(f"node {rank} exited with {_describe(code)}; no restart left "
                     f"({max_restarts} done)")
            return exit_code(code)
        _say(f"node {rank} exited with {_describe(code)}; restart {restart + 1} of "
             f"{max_restarts}")
    return 0  # pragma: no cover - the last round returns above


def _say(message: str) -> None:
    print(f"burncoll launch: {message}", file=sys.stderr, flush=True)


def _run_round(command: Sequence[str], envs: dict[int, dict[str, str]],
               wait_after_failure: float) -> tuple[int, int] | None:
    """Start one process per node, wait for them; ``(rank, returncode)`` of the first to fail.

    Once one fails, the others get ``wait_after_failure`` seconds before they are stopped.
    Every process is stopped when this returns or raises (an interrupt of the launcher).
    """
    lock = threading.Lock()
    procs: dict[int, subprocess.Popen[str]] = {}
    pumps: list[threading.Thread] = []
    try:
        for rank, env in envs.items():
            proc = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1,
            )
            procs[rank] = proc
            if proc.stdout is not None:
                pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout, lock),
                                        daemon=True)
                pump.start()
                pumps.append(pump)
        return _wait_round(procs, wait_after_failure)
    finally:
        _stop(list(procs.values()))
        for pump in pumps:
            pump.join(5)


def _wait_round(procs: dict[int, subprocess.Popen[str]], wait_after_failure: float
                ) -> tuple[int, int] | None:
    """Wait until every process exited, or ``wait_after_failure`` seconds after a failure."""
    failure: tuple[int, int] | None = None
    failed_at = 0.0
    while True:
        running = False
        for rank, proc in procs.items():
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 and failure is None:
                failure, failed_at = (rank, code), time.monotonic()
        if not running:
            return failure
        if failure is not None and time.monotonic() - failed_at >= wait_after_failure:
            return failure
        time.sleep(_POLL_SECONDS)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """Stop the processes still running: SIGTERM, then SIGKILL after :data:`STOP_SECONDS`."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
