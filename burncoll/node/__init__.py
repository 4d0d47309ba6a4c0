"""The node's global side: orchestrator client, data service, global executor, link."""

from burncoll.node.link import NodeLink, join_collective

__all__ = ["NodeLink", "join_collective"]
