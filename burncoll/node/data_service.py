"""The data service: this node's listener and its connections to every other node.

Each ordered pair of nodes has one connection, opened once at session start and reused for
every operation. The *receiving* node dials: node *b* opens a connection to *a*'s listener, and
*a* sends to *b* only on that connection (as its server side), so each connection has one
writer. Why the receiver dials: WebSocket clients must mask every frame (RFC 6455 section 5.3),
servers never do, so array bytes travel unmasked from a server and land in their buffer without
a pass over them on either side. Every connection is authenticated (challenge-response on the
shared token) before any frame is read, and every connection is read on both ends.

Without a configured token, member connections authenticate with the session's secret, which
the orchestrator hands every member with the node table (:meth:`DataService.set_session`): a
stranger who reaches a data port cannot pose as a member. The accepting side waits (at most
:data:`~burncoll.transport.base.PREAUTH_SECONDS`) until it knows the session before it
challenges the dialer. The dialer's first frame is ``hello`` naming its node and the session.

A member connection carries frames of the member at its other end only (a DATA header naming
another sender is a protocol error). Its reader stops reading while the mailbox holds too many
frames of operations not started here (see :mod:`burncoll.node.mailbox`: backpressure, not
hoarding).

Incoming DATA frames go to the :class:`Mailbox`; CONTROL frames carry aborts (another node
failed), ``bye`` (a node leaving cleanly) and status queries. A member connection that breaks
without ``bye``, or that sends bytes that are not a valid frame, fails the session with
:class:`~burncoll.PeerLost` / :class:`~burncoll.ProtocolError` on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from burncoll.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    PeerLost,
    ProtocolError,
    TransportError,
)
from burncoll.node.mailbox import Mailbox
from burncoll.transport.admission import BoundedLog
from burncoll.transport.auth import authenticate_client, authenticate_server
from burncoll.transport.base import PREAUTH_SECONDS, Buffer, Connection, Listener, Transport
from burncoll.transport.wire import FrameType, decode, encode_control, peek_part

__all__ = ["DataService", "NodeInfo", "error_from_abort"]

log = logging.getLogger("burncoll.node")
#: For what a stranger can cause at will (refused connections): bounded, see BoundedLog.
stranger_log = BoundedLog(log)

#: Seconds a failed send waits for another node's explanation before blaming the receiver.
_EXPLAIN_GRACE = 0.5

_ERRORS_BY_NAME: dict[str, type[CollectiveError]] = {
    cls.__name__: cls
    for cls in (CollectiveError, MismatchError, CollectiveTimeout, PeerLost, ProtocolError)
}


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of the session, as the orchestrator announced it."""

    index: int
    host: str
    port: int
    peer_ids: tuple[int, ...]
    #: The node runs its local all-reduce as a ring (it can shard across nodes).
    local_ring: bool = False

    def describe(self) -> str:
        return f"node {self.index} (peers {list(self.peer_ids)}, {self.host}:{self.port})"


def error_from_abort(message: dict[str, Any], nodes: Sequence[NodeInfo]) -> CollectiveError:
    """The exception an ``abort`` CONTROL message stands for (never anything but ours)."""
    cls = _ERRORS_BY_NAME.get(str(message.get("error")), CollectiveError)
    origin = message.get("node")
    text = str(message.get("message", "another node failed"))
    if isinstance(origin, int) and 0 <= origin < len(nodes):
        text = f"{text} (reported by {nodes[origin].describe()})"
    return cls(text)


class DataService:
    """Listener plus outgoing connections of one node; lives on the node's event loop."""

    def __init__(self, transport: Transport, host: str, port: int, token: str | None,
                 timeout: float, *, integrity: bool = False) -> None:
        self.transport = transport
        self.host = host
        self.requested_port = port
        self.token = token
        self.timeout = timeout
        #: Tag every message of member connections (see :mod:`burncoll.transport.auth`).
        self.integrity = integrity
        self.mailbox = Mailbox(self._describe)
        self.mailbox.on_error = self.fail
        self.session: int | None = None
        #: The session's secret (hex), when the orchestrator gave one: the token of member
        #: connections when no ``token`` is configured.
        self.secret: str | None = None
        self.node_index = -1
        self.nodes: tuple[NodeInfo, ...] = ()
        self._listener: Listener | None = None
        #: Connections this node sends on, by destination (each one dialed by its destination).
        self._out: dict[int, Connection] = {}
        self._send_locks: dict[int, asyncio.Lock] = {}
        self._all_out = asyncio.Event()  # set once every other node has dialed this one
        #: Connections this node dialed, to receive from each other node.
        self._dialed: dict[int, Connection] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._leaving: set[int] = set()
        self._known = asyncio.Event()
        self._closing = False
        self._telling: asyncio.Task[None] | None = None
        self._statuses: dict[int, dict[str, Any]] = {}
        self._status_event = asyncio.Event()
        self._failed = asyncio.Event()  # set with the session's failure
        #: Called once when the session fails because of another node (set by the link).
        self.on_failure: Callable[[BaseException], None] = lambda error: None
        #: Answers a status query: what this node's peers are doing.
        self.status: Callable[[], dict[str, Any]] = lambda: {}

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("data service not started")
        return self._listener.port

    async def start(self) -> None:
        """Bind the listener (port 0 picks a free one)."""
        try:
            self._listener = await self.transport.listen(self.host, self.requested_port,
                                                         self._serve)
        except TransportError as exc:
            raise TransportError(
                f"register: this node's data service {exc}; choose another data_service_port "
                "(0 picks a free one) or node_address"
            ) from exc

    def set_session(self, session: int, node_index: int, nodes: Sequence[NodeInfo],
                    secret: str | None = None) -> None:
        """This node's session (from the orchestrator's table); ``secret`` authenticates
        member connections when no token is configured."""
        self.session = session
        self.node_index = node_index
        self.nodes = tuple(nodes)
        self.secret = secret
        self._known.set()

    @property
    def member_token(self) -> str | None:
        """What member connections authenticate with: the token, else the session's secret."""
        return self.token if self.token is not None else self.secret

    def _describe(self, node: int) -> str:
        nodes = self.nodes
        return nodes[node].describe() if 0 <= node < len(nodes) else f"node {node}"

    # -- connections ---------------------------------------------------------------------------
    async def connect_all(self, deadline: float) -> None:
        """Dial every other node (to receive from it) and wait until every other node has
        dialed this one (to send to it), both by ``deadline``."""
        others = [n for n in self.nodes if n.index != self.node_index]
        await asyncio.gather(*(self._connect(n, deadline) for n in others))
        self._check_all_out()
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                await self._all_out.wait()
        except TimeoutError:
            missing = [n.describe() for n in others if n.index not in self._out]
            raise TransportError(
                f"{', '.join(missing)} did not connect to this node within "
                f"{self.timeout:g} s"
            ) from None

    def _check_all_out(self) -> None:
        if self.nodes and len(self._out) == len(self.nodes) - 1:
            self._all_out.set()

    async def _connect(self, node: NodeInfo, deadline: float) -> None:
        delay = 0.02
        while True:
            conn: Connection | None = None
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                    conn = await self.transport.connect(node.host, node.port)
                    conn = await authenticate_client(conn, self.member_token, self.timeout,
                                                     integrity=self.integrity)
                    await conn.send([encode_control(
                        {"type": "hello", "node": self.node_index, "session": self.session},
                        self.session or 0)])
                self._dialed[node.index] = conn
                # Array data arrives only here (the receiving node dials), and only node's.
                conn.place_with(functools.partial(self._place, node.index))
                reader = asyncio.get_running_loop().create_task(
                    self._read(conn, node.index, data=True))
                self._readers.add(reader)
                reader.add_done_callback(self._readers.discard)
                return
            except AuthenticationError:
                if conn is not None:
                    await conn.close()
                raise
            except (TransportError, TimeoutError, OSError) as exc:
                if conn is not None:
                    await conn.close()
                if time.monotonic() + delay >= deadline:
                    raise TransportError(
                        f"could not connect to {node.describe()} within {self.timeout:g} s: "
                        f"{exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _place(self, node: int, first: memoryview, size: int
               ) -> tuple[int, memoryview] | None:
        """A large DATA message from ``node`` is arriving: the memory its receiver made ready
        for it (:meth:`Mailbox.land`), or ``None`` to receive it into a buffer of its own.

        Only a part in ``node``'s own name may land: a member cannot start writing another
        node's part into its receiver's memory (and then trickle it past the operation's
        end); the header is checked in full once the message is whole."""
        peek = peek_part(first)
        if peek is None or peek.session != self.session or peek.key[3] != node or (
                peek.header_len + peek.payload_len != size):
            return None
        memory = self.mailbox.landing(peek.key, peek.offset, peek.payload_len)
        return None if memory is None else (peek.header_len, memory)

    async def send(self, node: int, parts: Sequence[Buffer]) -> None:
        """Send one frame to ``node``; a broken connection fails the session (PeerLost)."""
        conn = self._out.get(node)
        if conn is None:
            raise PeerLost(f"no connection to {self.nodes[node].describe()}")
        try:
            async with self._send_locks[node]:
                await conn.send(parts)
        except TransportError as exc:
            await self._await_explanation()
            self.fail(PeerLost(f"{self.nodes[node].describe()} is unreachable: {exc}"))
            # the session's failure: this one as fail() worded it, or an earlier one
            raise self.mailbox.error or PeerLost(str(exc)) from exc

    def send_now(self, node: int, parts: Sequence[Buffer]) -> bool:
        """From any thread: send a small frame to ``node`` at once, without the event loop,
        if its connection can (see ``Connection.send_now``); ``False``: use :meth:`send`."""
        conn = self._out.get(node)
        return conn is not None and conn.send_now(parts)

    async def tell_all(self, message: dict[str, Any], timeout: float = 1.0) -> None:
        """Best effort: send a CONTROL message to every other node, bounded in time."""
        frame = encode_control(message, self.session or 0)

        async def one(index: int, conn: Connection) -> None:
            try:
                async with asyncio.timeout(timeout), self._send_locks[index]:
                    await conn.send([frame])
            except (TransportError, TimeoutError):
                pass

        await asyncio.gather(*(one(i, c) for i, c in list(self._out.items())))

    # -- incoming ---------------------------------------------------------------------------
    async def _serve(self, conn: Connection) -> None:
        """An accepted connection: after authentication and ``hello``, this node sends to the
        dialer on it (and still reads it, as every connection)."""
        if self.token is None and not self._known.is_set():
            try:  # the session's secret is the key: wait for the table (bounded)
                async with asyncio.timeout(PREAUTH_SECONDS):
                    await self._known.wait()
            except TimeoutError:
                stranger_log.warning("no session", f"data service: dropped {conn.remote}: no "
                                     "session yet to authenticate it with (within "
                                     f"{PREAUTH_SECONDS:g} s)")
                return
        try:
            conn = await authenticate_server(conn, self.member_token, self.timeout,
                                             integrity=self.integrity)
        except (AuthenticationError, TransportError) as exc:
            stranger_log.warning("refused", f"data service: refused a connection from "
                                 f"{conn.remote}: {exc}")
            return
        try:
            hello = decode(await asyncio.wait_for(conn.recv(), self.timeout))
            async with asyncio.timeout(self.timeout):
                await self._known.wait()
            node = self._check_hello(hello.control, hello.frame_type)
        except (ProtocolError, TransportError, TimeoutError) as exc:
            log.warning("data service: dropped %s before it said hello: %s", conn.remote, exc)
            return
        if node in self._out:
            log.warning("data service: dropped a second connection from %s",
                        self.nodes[node].describe())
            return
        self._out[node] = conn
        self._send_locks[node] = asyncio.Lock()
        self._check_all_out()
        await self._read(conn, node, data=False)

    async def _read(self, conn: Connection, node: int, data: bool) -> None:
        """Read a member connection until it ends; its end or corruption fails the session.

        ``data``: the connection this node dialed, the only one ``node`` sends array data on
        (on the other, this node sends, and ``node`` only says what happens to it)."""
        try:
            await self._receive(conn, node, data)
        except ProtocolError as exc:
            if not self._closing:
                # the other end sent bytes that break the transport's framing, or refused
                # ours (a message over its limit): either way the connection is unusable
                error = ProtocolError(
                    f"{exc} (the connection with {self.nodes[node].describe()}); the "
                    "connection between members is corrupted")
                log.warning("data service: %s", error)
                self.fail(error)
        except TransportError as exc:
            if self._closing or node in self._leaving:
                return
            await self._await_explanation()
            self._lost(node, exc)
        except Exception as exc:  # a check that did not expect these bytes: still the peer's
            if not self._closing:
                error = ProtocolError(
                    f"{self.nodes[node].describe()} sent a frame this node cannot use "
                    f"({type(exc).__name__}: {exc}); the connection between members is "
                    "corrupted")
                log.warning("data service: %s", error)
                self.fail(error)

    def _check_hello(self, control: dict[str, Any] | None, frame_type: FrameType) -> int:
        if frame_type != FrameType.CONTROL or control is None or control["type"] != "hello":
            raise ProtocolError("expected a hello frame first")
        node = control.get("node")
        if not isinstance(node, int) or not 0 <= node < len(self.nodes) or (
            node == self.node_index
        ):
            raise ProtocolError(f"hello from an unknown node {node!r}")
        session = control.get("session")
        if session is None:
            raise ProtocolError(f"hello from node {node} without its session")
        if session != self.session:
            # a node of an earlier (failed) session reusing this address: never mix the two
            raise ProtocolError(f"hello from node {node} of another session ({session!r})")
        return node

    async def _receive(self, conn: Connection, node: int, data: bool) -> None:
        # A frame that breaks the protocol fails the session, but the connection stays open
        # (its frames are ignored from then on, the mailbox being failed): closing it would
        # reach the sender as a dead connection -- a PeerLost blaming a live node -- possibly
        # before the abort that says what really happened.
        while True:
            message = await conn.recv()
            try:
                frame = decode(message)
            except ProtocolError as exc:
                error = ProtocolError(
                    f"{self.nodes[node].describe()} sent a malformed frame ({exc}); the "
                    "connection between members is corrupted"
                )
                log.warning("data service: %s", error)
                self.fail(error)
                continue
            if frame.frame_type == FrameType.DATA:
                held = False
                try:
                    header = frame.header
                    if header is not None and header.session != self.session:
                        raise ProtocolError(
                            f"sent a frame of another session ({header.session:#x})")
                    if header is not None and header.src != node:
                        raise ProtocolError(f"sent a frame in the name of node {header.src}")
                    if not data:
                        raise ProtocolError("sent array data on the connection this node "
                                            "sends on")
                    held = self.mailbox.put(frame)
                except ProtocolError as exc:
                    self.fail(ProtocolError(
                        f"{self.nodes[node].describe()} {exc}; the connection between members "
                        "is corrupted, so the operation cannot be trusted"
                    ))
                if held and self.mailbox.crowded:
                    # Backpressure: read no further until this node starts the operations
                    # whose frames it holds (see burncoll.node.mailbox for why that comes).
                    await self.mailbox.drained()
                continue
            control = frame.control or {}
            kind = control.get("type")
            if kind == "bye":
                self._leaving.add(node)
                return
            if kind == "abort":
                self.fail(error_from_abort(control, self.nodes), tell=False)
            elif kind == "status?":
                await self._reply_status(node)
            elif kind == "status":
                self._statuses[node] = control
                self._status_event.set()

    async def _await_explanation(self) -> None:
        """A connection broke. A node that fails tells the others why and then closes its
        connections: the explanation travels on another connection and may come second, so
        wait a moment for it before a live node is reported lost."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_EXPLAIN_GRACE):
                await self._failed.wait()

    def _lost(self, node: int, exc: BaseException) -> None:
        if self._closing or node in self._leaving:
            return
        error = PeerLost(f"{self.nodes[node].describe()} disconnected ({exc})")
        log.warning("data service: %s", error)
        self.fail(error)

    # -- status queries (for timeout messages) -----------------------------------------------
    async def _reply_status(self, node: int) -> None:
        reply = {"type": "status", "node": self.node_index, **self.status()}
        conn = self._out.get(node)
        if conn is not None:
            try:
                async with asyncio.timeout(1.0), self._send_locks[node]:
                    await conn.send([encode_control(reply, self.session or 0)])
            except (TransportError, TimeoutError):
                pass

    async def query_status(self, nodes: Sequence[int], timeout: float) -> dict[int, dict[str, Any]]:
        """Ask ``nodes`` what their peers are doing; whoever answers within ``timeout``."""
        self._statuses = {}
        self._status_event = asyncio.Event()
        await self.tell_some(nodes, {"type": "status?", "node": self.node_index}, timeout)
        deadline = time.monotonic() + timeout
        while not all(n in self._statuses for n in nodes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._status_event.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._status_event.wait()
            except TimeoutError:
                break
        return dict(self._statuses)

    async def tell_some(self, nodes: Sequence[int], message: dict[str, Any],
                        timeout: float) -> None:
        frame = encode_control(message, self.session or 0)
        for index in nodes:
            conn = self._out.get(index)
            if conn is None:
                continue
            try:
                async with asyncio.timeout(timeout), self._send_locks[index]:
                    await conn.send([frame])
            except (TransportError, TimeoutError):
                pass

    # -- failure and shutdown -----------------------------------------------------------------
    def fail(self, error: BaseException, tell: bool = True) -> None:
        """Fail the session here; tell every other node unless the error came from one.

        A :class:`~burncoll.PeerLost` seen here gets what the other nodes need to act on it:
        the operation it interrupted, how far into it, and a hint.
        """
        if self.mailbox.error is not None:
            return
        if tell and type(error) is PeerLost:
            error = PeerLost(self._explain_lost(str(error)))
        self.mailbox.fail(error)
        for conn in [*self._out.values(), *self._dialed.values()]:
            conn.stop_placing()  # the failed operation's memory is its caller's again
        self._failed.set()
        self.on_failure(error)
        if tell and self._out:
            self._telling = asyncio.get_running_loop().create_task(self.tell_all({
                "type": "abort", "node": self.node_index,
                "error": type(error).__name__, "message": str(error),
            }))

    async def flush_abort(self) -> None:
        """Wait until the abort message of a local failure is sent (bounded by tell_all), so
        that the error reaches the other nodes even if this process exits right after."""
        telling = self._telling
        if telling is not None:
            await asyncio.shield(telling)

    def _explain_lost(self, what: str) -> str:
        what = what.removesuffix("; its process may have died")
        box = self.mailbox
        if box.running:
            elapsed = time.monotonic() - box.current_started
            when = (f"during operation #{box.current}, {elapsed:.1f} s after it started on "
                    f"this node (timeout {self.timeout:g} s)")
        elif box.current >= 0:
            when = f"after operation #{box.current}, before the next one"
        else:
            when = "before the first operation"
        return (
            f"{what} {when}; its process may have died. Hint: that node's own output says "
            "why; to go on, call burncoll.register(...) again on every peer, with a new process "
            "in its place"
        )

    async def close(self) -> None:
        """Say ``bye`` to every node, then close every connection and the listener.

        Connections close concurrently: a close waits for the other end to acknowledge
        (bounded by the transport), and the other end of a failed session may be gone.
        """
        self._closing = True
        await self.tell_all({"type": "bye", "node": self.node_index})
        conns = [*self._out.values(), *self._dialed.values()]
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        for reader in list(self._readers):  # one paused by backpressure reads no more
            reader.cancel()
        if self._listener is not None:
            await self._listener.close()
