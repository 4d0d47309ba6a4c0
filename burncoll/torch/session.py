"""The burncoll session behind one torch process group, met through torch's store.

:func:`open_session` turns the ``store`` torch hands a backend (whatever the ``init_method``)
into a burncoll collective of one node per rank and one peer per node (peer id = rank), as
docs/pytorch.md ("Rendezvous through torch's store", "Where rank 0 listens") describes: every
rank counts itself in at the store (``add``, which numbers the sessions a store has seen, so a
group created again never reads an old address); rank 0 starts an orchestrator and writes
``ok <nonce> <host:port>``, or ``error <why>`` so the others fail at once; every rank then
registers with the group's timeout and the rest of the config from the ``BURNCOLL_*``
variables. Each process group is a session of its own.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from burncoll.comm.communicator import Communicator, register
from burncoll.comm.registry import REGISTRY
from burncoll.config import CollectiveConfig
from burncoll.config.addresses import resolves_to_loopback, route_address
from burncoll.config.launchers import detect_launcher
from burncoll.config.values import parse_host_port
from burncoll.orchestration.orchestrator import Orchestrator, start_orchestrator

__all__ = ["open_session"]

#: Seconds rank 0 waits, closing a session's orchestrator, for ``finished`` messages on their
#: way to the other ranks (as groups.py does for a group's orchestrator).
_DRAIN_SECONDS = 5.0


def open_session(store: Store, rank: int, size: int, timeout: timedelta,
                 backend: str = "numpy", device: int = 0, label: str = "cpu") -> Communicator:
    """This rank's communicator in a new burncoll session of ``size`` nodes (see the module
    docstring); ``label`` keeps the keys of two sessions of one group apart in the store."""
    seconds = timeout.total_seconds()
    settings = CollectiveConfig(backend=backend, num_devices=1, num_nodes=1, node_rank=0,
                                global_address=None, host_orchestrator=False, timeout=seconds)
    if size == 1:
        return register(0, device, settings.replace(group=f"torch:{secrets.token_hex(8)}"))
    turn = (int(store.add(f"burncoll/{label}/joined", 1)) - 1) // size
    key = f"burncoll/{label}/{turn}"
    hosted = _host(store, key, settings, size) if rank == 0 else None
    nonce, address = _read_address(store, key) if rank else _published(store, key)
    try:
        comm = register(rank, device, settings.replace(
            num_nodes=size, node_rank=rank, global_address=address,
            group=f"torch:{nonce}"))
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    if hosted is not None:
        REGISTRY.on_close(comm._server, lambda: hosted.close(drain=_DRAIN_SECONDS))
    return comm


def _host(store: Store, key: str, settings: CollectiveConfig, size: int) -> Orchestrator:
    """Rank 0: start the session's orchestrator and publish its address (or why not)."""
    try:
        orchestrator = start_orchestrator(
            _orchestrator_host(settings, store), 0, settings.transport, settings.auth_token,
            timeout=settings.timeout, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
            tls_ca=settings.tls_ca, tls=settings.tls, integrity=settings.integrity,
            insecure=settings.insecure, expected_nodes=size)
    except Exception as exc:
        store.set(key, f"error rank 0 could not start burncoll's orchestrator: "
                       f"{type(exc).__name__}: {exc}")
        raise
    store.set(key, f"ok {secrets.token_hex(8)} {orchestrator.address}")
    return orchestrator


def _published(store: Store, key: str) -> tuple[str, str]:
    return _parse(store.get(key).decode(), key)


def _read_address(store: Store, key: str) -> tuple[str, str]:
    """(nonce, address) rank 0 published; a DistBackendError naming rank 0 if it did not."""
    try:
        record = store.get(key).decode()
    except dist.DistError as exc:
        raise dist.DistBackendError(
            f"burncoll: rank 0 did not publish the address of burncoll's orchestrator in "
            f"torch's store (key {key!r}) in time: is rank 0 alive and creating the same "
            f"process group? ({exc})") from exc
    return _parse(record, key)


def _parse(record: str, key: str) -> tuple[str, str]:
    parts = record.split(" ", 2)
    if parts[0] == "error":
        raise dist.DistBackendError(f"burncoll: {record[len('error '):]}")
    if parts[0] != "ok" or len(parts) != 3:
        raise dist.DistBackendError(f"burncoll: the store's {key!r} holds {record[:80]!r}, "
                                    "not burncoll's rendezvous record; is another program "
                                    "writing burncoll/ keys in torch's store?")
    return parts[1], parts[2]


def _orchestrator_host(settings: CollectiveConfig, store: Any) -> str:
    """Where rank 0 listens: ``node_address``; loopback when the launcher's variables say the
    whole job runs on this host (``torchrun --standalone`` names the host, not loopback);
    else this host's address toward the store's host (a TCPStore's, or ``MASTER_ADDR``),
    loopback when that is loopback or unknown."""
    if settings.node_address is not None:
        host, _ = parse_host_port(settings.node_address, "node_address", default_port=0)
        return host
    found = detect_launcher()
    if found is not None and found.all_on_one_host:
        return "127.0.0.1"
    while hasattr(store, "underlying_store"):  # PrefixStore around the job's store
        store = store.underlying_store
    target = getattr(store, "host", None) or os.environ.get("MASTER_ADDR")
    if not target or resolves_to_loopback(target):
        return "127.0.0.1"
    return route_address(target)
