"""``burncoll launch``: node processes of a script, on one machine or one per host, restarted.

:func:`launch_nodes` (``--nodes N``, like ``torchrun --standalone``) runs an orchestrator and N
node processes on this machine, on loopback and authenticated with a fresh random token when
none is given. :func:`launch_host` (``--nnodes N --node-rank R --master-addr HOST --master-port
PORT``), run once per host, runs this host's nodes; host 0's launcher also hosts the
orchestrator for the whole run. Hosts share a token given to them (a non-loopback ``HOST``
without one is an error). Nodes get their settings as ``BURNCOLL_*`` variables and torchrun's
(:func:`torchrun_environment`); the token travels in the environment, never argv.

``max_restarts``: when a node fails and restarts remain, the launcher stops its other nodes
(SIGTERM, then SIGKILL after :data:`STOP_SECONDS`) and starts them all again,
``BURNCOLL_RESTART_COUNT`` one higher; the orchestrator keeps running and the nodes form a new
session. In the last round the others get ``grace`` seconds to exit. The exit code is the
first failing node's in the last round (128 + N for signal N), else 0. A node that finished
before a peer died is not restarted, so a script should end with a collective (``finish``).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence

from burncoll.config.addresses import route_address
from burncoll.config.security import check_token, is_loopback
from burncoll.errors import ConfigError
from burncoll.orchestration.launch_rounds import (
    FAILURE_GRACE,
    STOP_SECONDS,
    EnvsFor,
    exit_code,
    run_rounds,
)
from burncoll.orchestration.orchestrator import start_orchestrator
from burncoll.protocol.fields import is_int

__all__ = ["FAILURE_GRACE", "RESTART_COUNT_ENV", "STOP_SECONDS", "exit_code", "free_port",
           "launch_host", "launch_nodes", "new_token", "node_environment", "torchrun_environment"]

#: The environment variable telling a node how many times its launcher restarted it.
RESTART_COUNT_ENV = "BURNCOLL_RESTART_COUNT"


def new_token() -> str:
    """A fresh random token for one run: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def node_environment(rank: int, nodes: int, devices: int, orchestrator: str, transport: str,
                     extra: dict[str, str] | None = None, *, node_address: str = "127.0.0.1",
                     restart: int = 0) -> dict[str, str]:
    """The environment of node ``rank``: the parent's plus the BURNCOLL_* settings.
    ``node_address``: where its data service listens (other nodes connect there); ``restart``: its
    ``BURNCOLL_RESTART_COUNT``."""
    env = dict(os.environ)
    env.update({"BURNCOLL_NODE_RANK": str(rank), "BURNCOLL_NUM_NODES": str(nodes),
                "BURNCOLL_NUM_DEVICES": str(devices), "BURNCOLL_GLOBAL_ADDRESS": orchestrator,
                "BURNCOLL_NODE_ADDRESS": node_address, "BURNCOLL_DATA_SERVICE_PORT": "0",
                "BURNCOLL_TRANSPORT": transport, RESTART_COUNT_ENV: str(restart),
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def torchrun_environment(rank: int, world: int, local: tuple[int, int], group: int,
                         master: tuple[str, int]) -> dict[str, str]:
    """The variables torchrun gives each process, with burncoll's meanings: one node process
    is one of torchrun's processes, whatever its ``--devices`` (threads). ``rank``: the node
    rank (``BURNCOLL_NODE_RANK``), of ``world`` node processes; ``local``: (its rank among the
    node processes on this host, their number); ``group``: the host's rank (torchrun's
    ``GROUP_RANK``); ``master``: ``MASTER_ADDR`` and ``MASTER_PORT``, a port for the script's
    own use (torch.distributed's store), not burncoll's rendezvous."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local[0]),
            "LOCAL_WORLD_SIZE": str(local[1]), "GROUP_RANK": str(group),
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}


def _security_environment(token: str | None, integrity: bool, tls: bool | None
                          ) -> dict[str, str]:
    """The settings every node must share with the orchestrator, as environment variables."""
    env = {"BURNCOLL_INTEGRITY": "1" if integrity else "0",
           "BURNCOLL_TLS": "auto" if tls is None else ("1" if tls else "0")}
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


def launch_nodes(command: Sequence[str], nodes: int, devices: int, transport: str = "websocket",
                 auth_token: str | None = None, grace: float = FAILURE_GRACE,
                 extra_env: dict[str, str] | None = None, *, integrity: bool = False,
                 tls: bool | None = None, max_restarts: int = 0) -> int:
    """Run ``command`` as ``nodes`` node processes around a fresh orchestrator. ``auth_token``: the
    run's token (``None``: a fresh one, :func:`new_token`), given to the nodes as
    ``BURNCOLL_AUTH_TOKEN``. ``integrity``, ``tls``: as the config fields. ``max_restarts``,
    ``grace``: see the module. Returns 0 when every node of the last round exits 0, else the exit
    code of the first that failed. Each node also gets torchrun's variables."""
    _check_restarts(max_restarts)
    token = new_token() if auth_token is None else auth_token
    extra = dict(extra_env or {})
    extra.update(_security_environment(token, integrity, tls))
    master = ("127.0.0.1", free_port())
    with start_orchestrator(transport=transport, auth_token=token, integrity=integrity,
                            tls=tls, expected_nodes=nodes) as orchestrator:
        envs_for = _host_envs(orchestrator.address, master, (0, 1, nodes), devices, transport,
                              extra, "127.0.0.1", token)
        return run_rounds(command, envs_for, max_restarts, grace,
                          lambda line: orchestrator.node_failed(_failed_reason(line)))


def launch_host(command: Sequence[str], nnodes: int, node_rank: int, master_addr: str,
                master_port: int, devices: int, transport: str = "websocket",
                auth_token: str | None = None, grace: float = FAILURE_GRACE,
                extra_env: dict[str, str] | None = None, *, integrity: bool = False,
                tls: bool | None = None, max_restarts: int = 0, node_address: str | None = None,
                min_nodes: int | None = None, min_nodes_wait: float = 30.0,
                nproc_per_node: int = 1) -> int:
    """Run host ``node_rank`` of ``nnodes`` hosts of ``command`` on this host: its
    ``nproc_per_node`` node processes, node ranks ``node_rank * nproc_per_node + i``.

    Call it on every host with the same arguments but ``node_rank``; host 0 also runs the
    orchestrator on ``master_addr:master_port`` until it returns. ``auth_token``: shared by every
    host; ``None`` only with a loopback ``master_addr`` (:class:`~burncoll.ConfigError`
    otherwise). ``node_address``: where this node's data service listens (default: the address
    routing to ``master_addr``). ``min_nodes`` (elastic, host 0): a session forms with at least
    ``min_nodes`` hosts when the others have not joined ``min_nodes_wait`` seconds after the
    ``min_nodes``-th did. The rest, and torchrun's variables (``MASTER_PORT`` the port after the
    orchestrator's): as :func:`launch_nodes`.
    """
    _check_host(nnodes, node_rank, master_addr, master_port, devices, nproc_per_node)
    _check_restarts(max_restarts)
    host = master_addr.strip().strip("[]")
    if auth_token is None and not is_loopback(host):
        raise ConfigError(missing_token_message(master_addr))
    check_token(auth_token, "the launch's auth token")
    extra = dict(extra_env or {})
    extra.update(_security_environment(auth_token, integrity, tls))
    per_host = nproc_per_node
    orchestrator = f"[{host}]:{master_port}" if ":" in host else f"{host}:{master_port}"
    master = (host, master_port + 1 if master_port < 65535 else master_port - 1)
    envs_for = _host_envs(orchestrator, master, (node_rank, nnodes, per_host), devices,
                          transport, extra, node_address or route_address(host), auth_token)
    if node_rank != 0:
        return run_rounds(command, envs_for, max_restarts, grace)
    with start_orchestrator(host, master_port, transport, auth_token, integrity=integrity,
                            tls=tls, expected_nodes=nnodes * per_host,
                            min_nodes=None if min_nodes is None else min_nodes * per_host,
                            min_nodes_wait=min_nodes_wait) as orch:
        return run_rounds(command, envs_for, max_restarts, grace,
                          lambda line: orch.node_failed(_failed_reason(line)))


def _host_envs(orchestrator: str, master: tuple[str, int], ranks: tuple[int, int, int],
               devices: int, transport: str, extra: dict[str, str], address: str,
               token: str | None) -> EnvsFor:
    """The environments of the node processes of host ``ranks[0]`` of ``ranks[1]``, each
    running ``ranks[2]``, around the orchestrator at ``orchestrator`` (``"host:port"``);
    ``master``: their torchrun ``MASTER_ADDR`` and ``MASTER_PORT``."""
    host_rank, hosts, per_host = ranks

    def envs_for(restart: int) -> dict[int, dict[str, str]]:
        envs = {}
        for local in range(per_host):
            rank = host_rank * per_host + local
            env = node_environment(rank, hosts * per_host, devices, orchestrator, transport,
                                   extra, node_address=address, restart=restart)
            env.update(torchrun_environment(rank, hosts * per_host, (local, per_host),
                                            host_rank, master))
            envs[rank] = _node_env(env, token)
        return envs

    return envs_for


def missing_token_message(master_addr: str) -> str:
    """Why a multi-host launch with a non-loopback master needs a token, and how to give it."""
    return (f"--master-addr {master_addr!r} is reachable from other machines, and no auth token is "
            "set: every host must hold the same token (a fresh random one would differ from host "
            "to host). Export the same BURNCOLL_AUTH_TOKEN=<secret> on every host, or copy a "
            "token file to every host and give it with --auth-token-file PATH (or "
            "BURNCOLL_AUTH_TOKEN_FILE=PATH); make a token with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'")


def _check_restarts(max_restarts: int) -> None:
    if not is_int(max_restarts, 0):
        raise ConfigError(f"max_restarts={max_restarts!r}: expected an int >= 0")


def _check_host(nnodes: int, node_rank: int, master_addr: str, master_port: int,
                devices: int, nproc_per_node: int) -> None:
    """:class:`ConfigError` for arguments of :func:`launch_host` that cannot work."""
    if not is_int(nnodes, 1):
        raise ConfigError(f"nnodes={nnodes!r}: expected an int >= 1 (the number of hosts)")
    if not is_int(node_rank, 0) or node_rank >= nnodes:
        raise ConfigError(f"node_rank={node_rank!r}: expected an int in [0, {nnodes}) "
                          f"(nnodes={nnodes}); give each host its own rank")
    if not isinstance(master_addr, str) or not master_addr.strip().strip("[]"):
        raise ConfigError(f"master_addr={master_addr!r}: expected the host name or address "
                          "of the node-rank-0 host")
    if not is_int(master_port, 1) or master_port > 65535:
        raise ConfigError(f"master_port={master_port!r}: expected a port in [1, 65535], the "
                          "same on every host")
    if not is_int(devices, 1):
        raise ConfigError(f"devices={devices!r}: expected an int >= 1")
    if not is_int(nproc_per_node, 1):
        raise ConfigError(f"nproc_per_node={nproc_per_node!r}: expected an int >= 1")


def _failed_reason(line: str) -> str:
    """What the nodes waiting at this launcher's orchestrator are told when one of its node
    processes failed (:meth:`~burncoll.Orchestrator.node_failed`)."""
    return f"burncoll launch: {line}; the collective this node waits for cannot form"


def free_port() -> int:
    """A port free on loopback now (a script's ``MASTER_PORT``, a baseline's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
