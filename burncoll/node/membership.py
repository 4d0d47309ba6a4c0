"""Session membership: who this node is in its session, and how other members' failures are
told.

The orchestrator's table (:class:`~burncoll.protocol.control.Table`) says which session this node
belongs to, its index, every member and the session's secret. :class:`Membership` keeps that,
checks a dialer's ``hello`` against it, and names members in errors. The rest of the module
turns what other members say about a failure into the error this node raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from burncoll.errors import (
    CollectiveError,
    ProtocolError,
    error_named,
)
from burncoll.node.mailbox import Mailbox
from burncoll.protocol.members import Abort, Hello

__all__ = ["Membership", "NodeInfo", "TableMismatch", "error_from_abort", "explain_lost",
           "table_digest"]

@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of the session, as the orchestrator announced it."""

    index: int
    host: str
    port: int
    peer_ids: tuple[int, ...]
    #: The node runs its local all-reduce as a ring (it can shard across nodes).
    sharded: bool = False
    #: Its host, as :func:`burncoll.transport.host_files.host_identity` names it (``""``:
    #: unknown, or shared memory turned off): nodes of one host share their host memory.
    host_id: str = ""
    #: It offers caller sockets (:mod:`burncoll.node.lanes`).
    lanes: bool = False

    def describe(self) -> str:
        return f"node {self.index} (peers {list(self.peer_ids)}, {self.host}:{self.port})"


class TableMismatch(ProtocolError):
    """Member ``node``'s hello carries the digest of another node table than this node's."""

    def __init__(self, node: int, message: str) -> None:
        super().__init__(message)
        self.node = node


def table_digest(session: int, nodes: Sequence[NodeInfo], secret: str | None) -> str:
    """A digest of everything the orchestrator's table says (but the receiver's own index):
    members that hold the same table compute the same, and every schedule they build from
    it is the same (32 hex digits)."""
    listed = [[n.index, n.host, n.port, list(n.peer_ids), n.sharded, n.host_id, n.lanes]
              for n in nodes]
    text = json.dumps([session, secret, listed], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def number_hosts(nodes: Sequence[NodeInfo]) -> tuple[int, ...]:
    """The host of each of ``nodes``, numbered from 0 in node order (equal host ids: equal
    numbers); ``()`` when a node's host is unknown (``shared_memory: false``, no ``/proc``):
    then nobody knows which nodes share a host."""
    if not all(n.host_id for n in nodes):
        return ()
    numbers: dict[str, int] = {}
    return tuple(numbers.setdefault(n.host_id, len(numbers)) for n in nodes)


class Membership:
    """This node's place in its session; unknown (``session`` is ``None``) until the
    orchestrator's table arrives (:meth:`join`)."""

    def __init__(self) -> None:
        self.session: int | None = None
        self.node_index = -1
        self.nodes: tuple[NodeInfo, ...] = ()
        #: The session's secret (hex), when the orchestrator gave one: the token of member
        #: connections when no token is configured.
        self.secret: str | None = None
        #: The table's :func:`table_digest` (every member says it in its hello).
        self.digest = ""
        #: Set once the session is known.
        self.known = asyncio.Event()

    def join(self, session: int, node_index: int, nodes: Sequence[NodeInfo],
             secret: str | None) -> None:
        self.session = session
        self.node_index = node_index
        self.nodes = tuple(nodes)
        self.secret = secret
        self.digest = table_digest(session, self.nodes, secret)
        self.known.set()

    def others(self) -> list[NodeInfo]:
        """Every member but this node."""
        return [n for n in self.nodes if n.index != self.node_index]

    def describe(self, node: int) -> str:
        nodes = self.nodes
        return nodes[node].describe() if 0 <= node < len(nodes) else f"node {node}"

    def check_hello(self, hello: Hello) -> int:
        """The member a dialer's ``hello`` names; :class:`ProtocolError` unless it is another
        member of this very session."""
        node = hello.node
        if not node < len(self.nodes) or node == self.node_index:
            raise ProtocolError(f"hello from an unknown node {node!r}")
        if hello.session != self.session:
            # a node of an earlier (failed) session reusing this address: never mix the two
            raise ProtocolError(f"hello from node {node} of another session "
                                f"({hello.session!r})")
        if hello.table != self.digest:
            # an authenticated member of this session, told something else by the orchestrator
            raise TableMismatch(node,
                f"{self.describe(node)} holds another table of session {self.session:x} than "
                f"{self.describe(self.node_index)} does (their digests differ: the members, "
                "their addresses, hosts or the session's secret): the orchestrator told its "
                "members different things, so they would build different schedules. It is "
                "faulty, or not the one program every node runs (a group's orchestrator runs "
                "in its rank 0's process); run every node and the orchestrator from the same "
                "burncoll")
        return node


def error_from_abort(abort: Abort, nodes: Sequence[NodeInfo]) -> CollectiveError:
    """The exception an :class:`Abort` stands for (never anything but ours)."""
    cls = error_named(abort.error)
    text = abort.message
    if abort.node < len(nodes):
        text = f"{text} (reported by {nodes[abort.node].describe()})"
    return cls(text)


def explain_lost(what: str, mailbox: Mailbox, timeout: float) -> str:
    """A lost member's :class:`~burncoll.PeerLost` message with what the other nodes need to
    act on it: the operation it interrupted, how far into it, and a hint."""
    what = what.removesuffix("; its process may have died")
    if mailbox.running:
        elapsed = time.monotonic() - mailbox.current_started
        when = (f"during operation #{mailbox.current}, {elapsed:.1f} s after it started on "
                f"this node (timeout {timeout:g} s)")
    elif mailbox.current >= 0:
        when = f"after operation #{mailbox.current}, before the next one"
    else:
        when = "before the first operation"
    return (
        f"{what} {when}; its process may have died. Hint: that node's own output says "
        "why; to go on, call burncoll.register(...) again on every peer, with a new process "
        "in its place"
    )
