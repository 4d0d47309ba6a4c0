"""The orchestrator that node 0 hosts inside its own process.

As torch's rank 0 hosts its TCPStore, node 0 with ``host_orchestrator`` (automatic under
torchrun, SLURM or mpirun) starts one on ``global_address`` when its peers register; it stays
up for the life of the process and the other nodes' registrations retry until it answers.
"""

from __future__ import annotations

import atexit
import threading

from burncoll.config import CollectiveConfig
from burncoll.config.values import parse_host_port
from burncoll.errors import TransportError
from burncoll.orchestration.orchestrator import Orchestrator, start_orchestrator

__all__ = ["hosted_orchestrator"]

_LOCK = threading.Lock()
#: Seconds the exiting host waits for ``finished`` messages still on their way to other nodes.
_DRAIN_SECONDS = 5.0
_HOSTED: dict[tuple[str, int, str], Orchestrator] = {}


def hosted_orchestrator(config: CollectiveConfig) -> Orchestrator | None:
    """The orchestrator this process hosts for ``config``, started on first use; ``None`` when the
    config does not ask this process to host one. Raises :class:`~burncoll.TransportError` naming
    the address when it cannot be bound."""
    if not config.host_orchestrator or config.global_address is None or config.node_rank:
        return None  # only node 0 hosts, so the setting may be the same on every node
    host, port = parse_host_port(config.global_address, "global_address")
    key = (host, port, config.transport)
    with _LOCK:
        running = _HOSTED.get(key)
        if running is not None:
            return running
        try:
            running = start_orchestrator(
                host, port, config.transport, config.auth_token, timeout=config.timeout,
                tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca,
                tls=config.tls, integrity=config.integrity, insecure=config.insecure,
                expected_nodes=config.num_nodes)
        except TransportError as exc:
            raise TransportError(
                f"node 0 hosts the orchestrator at {config.global_address} and cannot listen "
                f"there ({exc}). Is node 0 on that host, and is the port free? Choose another "
                "port with MASTER_PORT (burncoll takes MASTER_PORT + 1; torchrun "
                "--master-port) or BURNCOLL_GLOBAL_ADDRESS=host:port on every node; if an "
                "orchestrator of your own already runs there, set BURNCOLL_HOST_ORCHESTRATOR=0"
            ) from None
        if not _HOSTED:
            atexit.register(_close_all)
        _HOSTED[key] = running
        return running


def _close_all() -> None:
    with _LOCK:
        hosted = list(_HOSTED.values())
        _HOSTED.clear()
    for orchestrator in hosted:
        orchestrator.close(drain=_DRAIN_SECONDS)
