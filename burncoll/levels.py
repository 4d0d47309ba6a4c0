"""The local server's view of the global level: what a node-to-node link must provide.

The local server calls these from peer threads; each call blocks until the node-level part
of the operation is done on this node, or raises a :class:`~burncoll.CollectiveError` by
``op.deadline``. All buffers are host NumPy arrays; ``channel`` separates concurrent
sub-collectives of one operation (one per local shard).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from burncoll.ops import OpKind, ReduceOp

__all__ = ["GlobalLink", "GlobalOp", "HostArray"]

HostArray = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class GlobalOp:
    """One operation as the nodes see it: its fingerprint, sequence number and deadline."""

    seq: int
    kind: OpKind
    reduce_op: ReduceOp | None
    dtype: str | None
    shape: tuple[int, ...]
    root: int
    deadline: float
    started: float

    @property
    def label(self) -> str:
        return f"{self.kind.label} #{self.seq}"


class GlobalLink(Protocol):
    """A node's connection to the other nodes of the collective."""

    node_index: int
    num_nodes: int
    #: Every peer id of the collective, sorted (a peer's rank is its index here).
    peer_ids: tuple[int, ...]
    #: The node index hosting each peer id.
    node_of: Mapping[int, int]
    #: All-reduce shards across nodes: every node runs a local ring over as many devices.
    sharded: bool

    def all_reduce(self, op: GlobalOp, buf: HostArray, channel: int = 0,
                   out: HostArray | None = None) -> None:
        """Reduce the flat ``buf`` over all nodes, bitwise identical everywhere.

        In place by default. With ``out`` (same dtype and size as ``buf``, C-contiguous,
        writable, not overlapping it) ``buf`` is only read -- it may be read-only, e.g. the
        caller's own input -- and the result is written to ``out``: no copy of the input is
        needed to keep it intact.
        """
        ...

    def reduce(self, op: GlobalOp, buf: HostArray, root_node: int) -> None:
        """Reduce ``buf`` over all nodes into ``root_node``'s ``buf`` (in place)."""
        ...

    def broadcast(self, op: GlobalOp, buf: HostArray | None, root_node: int) -> HostArray:
        """``root_node``'s flat ``buf`` on every node (returned; dtype/shape from the root)."""
        ...

    def reduce_scatter(
        self, op: GlobalOp, buf: HostArray, layout: Sequence[tuple[int, int]],
        owners: Sequence[int],
    ) -> None:
        """Reduce chunk ``c`` (``layout[c]`` of ``buf``) over all nodes into node
        ``owners[c]``'s ``buf``; other chunks are left unspecified."""
        ...

    def all_gather(self, op: GlobalOp, mine: Mapping[int, HostArray]) -> list[HostArray]:
        """Every peer's array, by rank: ``mine`` maps this node's ranks to their arrays."""
        ...

    def barrier(self, op: GlobalOp) -> None:
        """Return once every node has reached this barrier."""
        ...

    def abort(self, error: BaseException) -> None:
        """Tell every other node that the collective failed with ``error``."""
        ...

    def close(self, deadline: float) -> None:
        """Leave the collective cleanly (all nodes finish together where possible)."""
        ...
