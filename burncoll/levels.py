"""What each level sees of the other: the types the local and the node level share.

The local peers' rendezvous sees the global level as a :class:`GlobalLink`, and calls it from
peer threads; each call blocks until the node-level part of the operation is done on this
node, or raises a :class:`~burncoll.CollectiveError` by ``op.deadline``. All buffers are host
NumPy arrays; ``channel`` separates concurrent sub-collectives of one operation (one per local
shard). The node level sees the local level as :class:`LocalPeers`: it reports failures there
and answers other nodes' status queries from it, and never imports the local level.

The route of an operation is decided once, by the local level
(:func:`burncoll.local.plans.choose.choose`), from the call and the capabilities the nodes
agreed when they joined (:class:`GlobalLink`'s ``lanes``, ``host_memory``, ``host_mail``):
every global call carries its whole :data:`Route` -- the one-round :class:`Exchange` on its
:class:`Medium`, :class:`HostGather`, :class:`HostReduce`, or a concrete strategy, ``auto``
already resolved --
and the link runs what it is told, with no size test and no fallback of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from burncoll.compression import of_root
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Schedule, Strategy

__all__ = [
    "MAX_TAG", "Exchange", "GlobalLink", "GlobalOp", "HostArray", "HostGather", "HostReduce",
    "LocalPeers",
    "Medium", "Route",
]

HostArray = np.ndarray[Any, Any]

#: The largest point-to-point tag: it travels in a DATA header's u16 ``channel``.
MAX_TAG = 2**16 - 1


class Medium(enum.Enum):
    """What carries the messages of an :class:`Exchange`."""

    #: The caller sockets (:mod:`burncoll.node.lanes`): the calling thread sends and reads.
    LANE = "lane"
    #: The host mail in the nodes' shared memory (:mod:`burncoll.node.host_mail`).
    HOST = "host"
    #: The member connections, through the event loop (no lanes: QUIC, TLS, integrity
    #: tags, ``caller_sockets: false``; or a channel other than 0).
    CONNECTIONS = "connections"


@dataclass(frozen=True, slots=True)
class Exchange:
    """The one-round exchange on ``medium``: every node sends its array to every other node
    and reduces them all itself (``auto``'s route for small all-reduces, and for barriers
    with an empty array)."""

    medium: Medium


@dataclass(frozen=True, slots=True)
class HostReduce:
    """Every node of one host writes its array into its shared memory, reduces a chunk of
    all of them and copies the result out (:mod:`burncoll.node.host_reduce`; ``auto``'s route
    for all-reduces past the exchange among the node processes of one host, on
    channel 0)."""


@dataclass(frozen=True, slots=True)
class HostGather:
    """Every node of one host posts its array in the host mail, node 0 reads them all,
    reduces them in node order and posts the result, and the others copy it
    (:meth:`burncoll.node.host_mail.SharedMail.gather`): ``2 (N - 1)`` messages read where
    the exchange reads ``N (N - 1)`` (``auto``'s route in place of the exchange in the host
    mail from :data:`~burncoll.strategies.auto.GATHER_NODES` node processes, on channel
    0)."""


#: How the nodes run a global all-reduce or barrier: the exchange on a medium, the host
#: gather, the host reduction (an all-reduce), or a concrete strategy's schedule (never
#: :class:`~burncoll.strategies.Auto`). A barrier's route is never :class:`HostReduce`.
Route = Exchange | HostGather | HostReduce | Strategy


class GlobalOp(NamedTuple):
    """One operation as the nodes see it: its fingerprint, sequence number and deadline.

    (A named tuple, immutable as a frozen dataclass, and made for every operation at a
    third of the cost.)"""

    seq: int
    kind: OpKind
    reduce_op: ReduceOp | None
    dtype: str | None
    shape: tuple[int, ...]
    root: int
    deadline: float
    started: float

    def fingerprint(self) -> tuple[object, ...]:
        """What every node's call must agree on; a frame's header carries the same tuple
        (:meth:`burncoll.protocol.wire.DataHeader.fingerprint`)."""
        return self[1:6]

    @property
    def label(self) -> str:
        return f"{self.kind.label} #{self.seq}"

    @property
    def compression(self) -> str | None:
        """The 16-bit wire format of a compressed all-reduce (:mod:`burncoll.compression`),
        which its ``root`` carries; ``None`` for every other operation."""
        return of_root(self.root) if self.kind is OpKind.ALL_REDUCE else None


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
    #: Every node runs on this node's host and shares memory with it (same host identity).
    one_host: bool
    #: Every node uses caller sockets (:data:`Medium.LANE`), agreed in the table.
    lanes: bool
    #: Every node mapped every other node's shared memory at join (:class:`HostReduce`):
    #: one host, lanes, and an all-answers round, so every node holds the same bool.
    host_memory: bool
    #: And every node's processor allows the host mail (:data:`Medium.HOST`).
    host_mail: bool
    #: The host of each node, numbered from 0 in node order (equal: they share memory);
    #: ``()`` when some node's host is unknown.
    hosts: tuple[int, ...]
    #: Whether a call of this node raised a CollectiveError (set by the API): closing the
    #: link then does not raise the session's failure again.
    failure_reported: bool

    def all_reduce(self, op: GlobalOp, buf: HostArray, channel: int = 0,
                   out: HostArray | None = None, *, route: Route, fresh: bool = False) -> None:
        """Reduce the flat ``buf`` over all nodes, bitwise identical everywhere.

        ``route``: the one-round :class:`Exchange` on its medium (every node sends ``buf`` to
        every other node and reduces them all itself), :class:`HostReduce` (channel 0, with
        ``host_memory``), or the strategy whose all-reduce schedule runs. Every node must
        pass the same route for the same operation.

        In place by default. With ``out`` (same dtype and size as ``buf``, C-contiguous,
        writable, not overlapping it) ``buf`` is only read -- it may be read-only, e.g. the
        caller's own input -- and the result is written to ``out``: no copy of the input is
        needed to keep it intact. ``fresh``: ``out`` is a new array made for this call like
        ``buf`` (the pool's ``fresh``), so it is not checked.
        """
        ...

    def reduce(self, op: GlobalOp, buf: HostArray, root_node: int, *,
               strategy: Strategy) -> None:
        """Reduce ``buf`` over all nodes into ``root_node``'s ``buf`` (in place), by
        ``strategy``'s reduce schedule (as are the other operations by theirs)."""
        ...

    def broadcast(self, op: GlobalOp, buf: HostArray | None, root_node: int, *,
                  strategy: Strategy) -> HostArray:
        """``root_node``'s flat ``buf`` on every node (returned; dtype/shape from the root)."""
        ...

    def reduce_scatter(
        self, op: GlobalOp, buf: HostArray, layout: Sequence[tuple[int, int]],
        owners: Sequence[int], *, strategy: Strategy,
    ) -> None:
        """Reduce chunk ``c`` (``layout[c]`` of ``buf``) over all nodes into node
        ``owners[c]``'s ``buf``; other chunks are left unspecified."""
        ...

    def all_gather(self, op: GlobalOp, mine: Mapping[int, HostArray], *,
                   strategy: Strategy) -> list[HostArray]:
        """Every peer's array, by rank: ``mine`` maps this node's ranks to their arrays."""
        ...

    def route(self, op: GlobalOp, schedule: Schedule,
              chunks: list[HostArray | None]) -> list[HostArray | None]:
        """Walk a direct ``schedule`` (:mod:`burncoll.strategies.direct`) over ``chunks``:
        this node's chunks are sent where the schedule says, and the chunks it receives are
        filled in (allocated from their headers when ``None``); returns ``chunks``."""
        ...

    def barrier(self, op: GlobalOp, *, route: Exchange | HostGather | Strategy) -> None:
        """Return once every node has reached this barrier (``route``: a one-round
        :class:`Exchange` of empty messages, the :class:`HostGather` of empty messages, or the
        strategy's all-reduce schedule)."""
        ...

    def p2p_send(self, src: int, dst: int, tag: int, buf: HostArray, deadline: float
                 ) -> Future[None]:
        """Send ``buf`` from local peer ``src`` to peer ``dst`` of another node under ``tag``
        (peer ids); at once. The future completes once ``dst``'s recv took the message
        (:class:`~burncoll.MismatchError` if that recv refused it), or fails by ``deadline``
        (which fails the collective). ``buf`` is read until then: keep it unchanged."""
        ...

    def p2p_recv(self, src: int, dst: int, tag: int, deadline: float,
                 want: tuple[str, tuple[int, ...]] | None = None) -> Future[HostArray]:
        """Receive the next message from peer ``src`` of another node to local peer ``dst``
        under ``tag``; at once. The future completes with a new host array (the sender's
        dtype and shape), or fails by ``deadline``. ``want``: the dtype and shape the
        receiver takes (its ``out=``); another one refuses the message on both sides."""
        ...

    def abort(self, error: BaseException) -> None:
        """Tell every other node that the collective failed with ``error``."""
        ...

    def close(self, deadline: float) -> None:
        """Leave the collective cleanly (all nodes finish together where possible)."""
        ...


class LocalPeers(Protocol):
    """What the node level may ask of its local peers' rendezvous."""

    def fail(self, error: BaseException, *, remote: bool = False) -> None:
        """Abort the local peers with ``error`` (``remote``: another node reported it, so
        the other nodes need not be told)."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """The error that aborted the local peers, if any."""
        ...

    def status(self) -> dict[str, Any]:
        """Which local peers have arrived at which operations (for other nodes' queries)."""
        ...
