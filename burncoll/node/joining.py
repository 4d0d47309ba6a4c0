"""Joining a multi-node collective: the data service, the orchestrator, then every node.

Once every node is connected, node processes of one host set up their host memory
(:meth:`~burncoll.node.link.NodeLink.share_host_memory`), so that the capabilities the
routes are chosen from are agreed before the first operation.

A node that fails before it could join (too low a descriptor limit for the session's size:
:mod:`burncoll.node.descriptors`; its data service's port is in use, two of its peers
registered one id) tells the orchestrator so, with :class:`~burncoll.protocol.control.Abandon`:
the nodes already waiting for it then fail at once with its error, naming it, instead of
waiting out their timeout with a bare :class:`~burncoll.CollectiveTimeout`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

from burncoll.config import CollectiveConfig
from burncoll.config.values import parse_host_port
from burncoll.errors import CollectiveError
from burncoll.ioloop import IoLoop
from burncoll.node.data_service import DataService
from burncoll.node.descriptors import ensure_descriptors
from burncoll.node.link import NodeLink
from burncoll.node.orchestrator_client import ABANDON_SECONDS, OrchestratorClient
from burncoll.protocol.control import MAX_REASON, Abandon, Join
from burncoll.strategies import Ring
from burncoll.transport import get_transport
from burncoll.transport.base import Transport
from burncoll.transport.host_files import host_identity

__all__ = ["join_collective", "report_failure"]


def join_collective(config: CollectiveConfig, local_peer_ids: Sequence[int]) -> NodeLink:
    """Join the multi-node collective of ``config`` with this node's peers (blocking)."""
    deadline = time.monotonic() + config.timeout
    node_host, node_port = parse_host_port(config.node_address or "127.0.0.1", "node_address",
                                           default_port=0)
    port = config.data_service_port or node_port
    transport = get_transport(config.transport, tls=config.tls_settings())
    io = IoLoop(f"burncoll-node-{min(local_peer_ids)}")
    try:
        service = DataService(transport, node_host, port, config.auth_token, config.timeout,
                              integrity=config.integrity, lanes=config.uses_lanes)
        orch = _client(config, transport)
        io.run(_join(service, orch, config, local_peer_ids, deadline), deadline, "register")
    except BaseException:
        io.stop()
        raise
    link = NodeLink(io, service, orch)
    try:
        link.share_host_memory(deadline)
    except BaseException as exc:
        link.failure_reported = True  # (raised here: closing does not raise it again)
        link.abort(exc)  # (the other nodes' set-up fails at once, naming this node's error)
        with contextlib.suppress(CollectiveError):
            link.close(deadline)
        raise
    return link


def report_failure(config: CollectiveConfig, local_peer_ids: Sequence[int],
                   error: BaseException) -> None:
    """Tell the orchestrator of ``config`` that this node failed with ``error`` before it
    joined (blocking, at most :data:`ABANDON_SECONDS`; best effort: nothing is raised)."""
    deadline = time.monotonic() + ABANDON_SECONDS
    io = IoLoop(f"burncoll-abandon-{min(local_peer_ids, default=0)}")
    try:
        transport = get_transport(config.transport, tls=config.tls_settings())
        io.run(_client(config, transport).abandon(abandon_message(config, local_peer_ids, error),
                                       deadline), deadline + 1.0, "report the failure")
    except CollectiveError:
        pass
    finally:
        io.stop()


def abandon_message(config: CollectiveConfig, local_peer_ids: Sequence[int],
                    error: BaseException) -> Abandon:
    """What a node that failed with ``error`` before it joined tells the orchestrator."""
    reason = str(error) or type(error).__name__
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON - 3] + "..."
    return Abandon(config.node_rank or 0, tuple(sorted(set(local_peer_ids))),
                   config.global_fingerprint(), type(error).__name__[:40], reason, os.getpid())


def _client(config: CollectiveConfig, transport: Transport) -> OrchestratorClient:
    host, port = parse_host_port(config.global_address or "", "global_address")
    return OrchestratorClient(transport, host, port, config.auth_token, config.timeout,
                              integrity=config.integrity)


async def _join(service: DataService, orch: OrchestratorClient, config: CollectiveConfig,
                local_peer_ids: Sequence[int], deadline: float) -> None:
    try:  # (the number of nodes, where the config says it: else once the table says it)
        ensure_descriptors(config.num_nodes or 1)
        await service.start()
    except CollectiveError as exc:
        await orch.abandon(abandon_message(config, local_peer_ids, exc),
                           min(deadline, time.monotonic() + ABANDON_SECONDS))
        raise
    try:
        await orch.join(Join(
            service.host, service.port, tuple(local_peer_ids), config.global_fingerprint(),
            pid=os.getpid(),
            meta={"sharded": isinstance(config.strategy("local_all_reduce_strategy"), Ring),
                  "host": host_identity() if config.shared_memory else "",
                  "lanes": config.uses_lanes},
        ), deadline)
        ensure_descriptors(len(orch.nodes))
        # Without a token, member connections authenticate with the session's own secret
        # (from the orchestrator's table): a stranger cannot pose as a member.
        service.set_session(orch.session, orch.index, orch.nodes, secret=orch.secret)
        await service.connect_all(deadline)
    except BaseException:
        await service.close()
        await orch.close()
        raise
