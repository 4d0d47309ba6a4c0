"""burncoll: collective operations over arrays of any backend, on one node and across nodes.

Thread per device, process per node: every peer thread calls :func:`register` and then the
collectives of its :class:`Communicator`. See the README for the tour.
"""

from burncoll.backends import get_backend
from burncoll.comm.communicator import Communicator, node_rank, peer_ids, register
from burncoll.config import CollectiveConfig
from burncoll.errors import (
    AuthenticationError,
    BackendUnavailable,
    CollectiveAborted,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    MismatchError,
    PeerLost,
    ProtocolError,
    TransportError,
    UsageError,
)
from burncoll.ops import ReduceOp
from burncoll.orchestration.orchestrator import Orchestrator, start_orchestrator
from burncoll.strategies import Auto, Centralized, Doubling, Ring, Strategy, Tree
from burncoll.work import Work

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "Auto",
    "BackendUnavailable",
    "Centralized",
    "CollectiveAborted",
    "CollectiveConfig",
    "CollectiveError",
    "CollectiveTimeout",
    "Communicator",
    "ConfigError",
    "Doubling",
    "MismatchError",
    "Orchestrator",
    "PeerLost",
    "ProtocolError",
    "ReduceOp",
    "Ring",
    "Strategy",
    "TransportError",
    "Tree",
    "UsageError",
    "Work",
    "get_backend",
    "node_rank",
    "peer_ids",
    "register",
    "start_orchestrator",
]
