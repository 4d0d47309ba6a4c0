"""The node's global side: orchestrator client, data service, global executor, link."""

from burncoll.node.joining import join_collective, report_failure
from burncoll.node.link import NodeLink

__all__ = ["NodeLink", "join_collective", "report_failure"]
