"""Dialing and hello: how the member connections of a session are opened and accepted.

Each ordered pair of nodes has one connection, and the *receiving* node dials it (see
:mod:`burncoll.node.data_service` for why). Every connection is authenticated
(challenge-response) before any frame is read: on the configured token, or without one on the
session's secret, which the orchestrator hands every member with its table -- so a stranger
who reaches a data port cannot pose as a member. The accepting side therefore waits (at most
:data:`~burncoll.transport.base.PREAUTH_SECONDS`) until it knows the session before it
challenges the dialer. The dialer's first frame is
:class:`~burncoll.protocol.members.Hello`, naming its node and the session.

**At most :data:`DIALS_AT_ONCE` dials at a time, in turn.** Every member dials many others at
session start, and on one host they all dial from one address: a listener holds at most 16
connections of one source that have not authenticated yet (``max_pending_per_source``,
:mod:`burncoll.transport.admission`) and evicts the oldest past that. With every node dialing
every other at once, 64 node processes of one host evicted each other's dials faster than they
authenticated (issue 32: no node registered within 300 s). So a node keeps at most
:data:`DIALS_AT_ONCE` dials in flight, and dials the others in turn from its own index on
(:meth:`Dialing.in_turn`: node ``i`` first dials ``i + 1``, then ``i + 2``, ...), so that at
any moment each listener is being dialed by a few nodes, not by all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from burncoll.errors import AuthenticationError, ProtocolError, TransportError
from burncoll.node.membership import Membership, NodeInfo, TableMismatch
from burncoll.protocol.control import encode, kind_of
from burncoll.protocol.members import Hello, decode_member
from burncoll.protocol.wire import decode
from burncoll.transport.admission import BoundedLog
from burncoll.transport.auth import authenticate_client, authenticate_server
from burncoll.transport.base import PREAUTH_SECONDS, Connection, Transport
from burncoll.transport.stream_connection import StreamConnection

__all__ = ["DIALS_AT_ONCE", "Dialing"]

log = logging.getLogger("burncoll.node")
#: For what a stranger can cause at will (refused connections): bounded, see BoundedLog.
stranger_log = BoundedLog(log)
#: The most dials (connect, authentication, hello) one node has in flight (see the module).
DIALS_AT_ONCE = 4


class Dialing:
    """Opens this node's connections to the other members, and accepts theirs."""

    def __init__(self, transport: Transport, token: str | None, timeout: float,
                 integrity: bool, membership: Membership) -> None:
        self.transport = transport
        self.token = token
        self.timeout = timeout
        #: Tag every message of member connections (see :mod:`burncoll.transport.auth`).
        self.integrity = integrity
        self.membership = membership
        self._slots = asyncio.Semaphore(DIALS_AT_ONCE)

    def in_turn(self, nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
        """``nodes`` in the order this node dials them: from the one after it on, wrapping
        around (so that the nodes of a session spread their dials over the listeners)."""
        me, count = self.membership.node_index, max(len(self.membership.nodes), 1)
        return sorted(nodes, key=lambda n: (n.index - me) % count)

    @property
    def member_token(self) -> str | None:
        """What member connections authenticate with: the token, else the session's secret."""
        return self.token if self.token is not None else self.membership.secret

    async def dial(self, node: NodeInfo, deadline: float, *, lane: bool = False) -> Connection:
        """An authenticated connection to ``node`` that has said hello, retried with backoff
        until ``deadline`` (at most :data:`DIALS_AT_ONCE` at a time);
        :class:`~burncoll.AuthenticationError` at once. ``lane``: it is
        to be the two nodes' caller socket (:mod:`burncoll.node.lanes`): reading stops before
        the hello leaves, so the other node's first byte on it stays in the socket."""
        me = self.membership
        session = me.session or 0
        hello = encode(Hello(me.node_index, session, lane, me.digest), session)
        delay = 0.02
        while True:
            conn: Connection | None = None
            try:
                async with self._slots, asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                    conn = await self.transport.connect(node.host, node.port)
                    conn = await authenticate_client(conn, self.member_token, self.timeout,
                                                     integrity=self.integrity)
                    if lane and isinstance(conn, StreamConnection):
                        conn.pause_reading()
                    await conn.send([hello])
                return conn
            except (TransportError, TimeoutError, OSError) as exc:  # (AuthenticationError too)
                if conn is not None:
                    await conn.close()
                if isinstance(exc, AuthenticationError):
                    raise
                if time.monotonic() + delay >= deadline:
                    why = str(exc) or (
                        "the connection and its handshake did not complete in time (is that "
                        "host overloaded, or a firewall dropping its packets?)"
                        if isinstance(exc, TimeoutError) else type(exc).__name__)
                    raise TransportError(f"could not connect to {node.describe()} within "
                                         f"{self.timeout:g} s: {why}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def accept(self, conn: Connection) -> tuple[int, Connection, bool] | None:
        """The member an accepted connection comes from, once it is authenticated and said
        hello, the connection to use, and whether the member asked for it as their caller
        socket; ``None`` (logged) when it is dropped. :class:`TableMismatch` when a member
        of this session holds another node table."""
        if self.token is None and not self.membership.known.is_set():
            try:  # the session's secret is the key: wait for the table (bounded)
                async with asyncio.timeout(PREAUTH_SECONDS):
                    await self.membership.known.wait()
            except TimeoutError:
                stranger_log.warning("no session", f"data service: dropped {conn.remote}: no "
                                     "session yet to authenticate it with (within "
                                     f"{PREAUTH_SECONDS:g} s)")
                return None
        try:
            conn = await authenticate_server(conn, self.member_token, self.timeout,
                                             integrity=self.integrity)
        except (AuthenticationError, TransportError) as exc:
            stranger_log.warning("refused", f"data service: refused a connection from "
                                 f"{conn.remote}: {exc}")
            return None
        try:
            node, lane = await self._hello(conn)
            return node, conn, lane
        except TableMismatch:
            await conn.close()
            raise  # (a member: the session fails)
        except (ProtocolError, TransportError, TimeoutError) as exc:
            log.warning("data service: dropped %s before it said hello: %s", conn.remote, exc)
            return None

    async def _hello(self, conn: Connection) -> tuple[int, bool]:
        frame = decode(await asyncio.wait_for(conn.recv(), self.timeout))
        async with asyncio.timeout(self.timeout):
            await self.membership.known.wait()
        hello = decode_member(frame) if kind_of(frame) == Hello.KIND else None
        if not isinstance(hello, Hello):
            raise ProtocolError("expected a hello frame first")
        return self.membership.check_hello(hello), hello.lane
