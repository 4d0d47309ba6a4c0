"""The data service: this node's listener and its connections to every other node.

Each ordered pair of nodes has one authenticated connection, opened at session start and
reused; the *receiving* node dials, so array bytes travel from the server side (unmasked over
WebSocket) and each connection has one writer (docs/architecture.md). :class:`DataService`
composes :class:`~burncoll.node.membership.Membership`, :class:`~burncoll.node.dialing.Dialing`,
:class:`~burncoll.node.connections.MemberConnections`, :mod:`~burncoll.node.placement`,
:class:`~burncoll.node.reading.MemberReader` and the point-to-point
:class:`~burncoll.node.inbox.Inbox` and :class:`~burncoll.node.p2p_outbox.Outbox`. A member
connection that breaks without ``bye`` or sends an invalid frame fails the session on every
node (:class:`~burncoll.PeerLost` / :class:`~burncoll.ProtocolError`, told to the others by
:class:`~burncoll.protocol.members.Abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from burncoll.errors import MismatchError, PeerLost, ProtocolError, TransportError
from burncoll.node.connections import MemberConnections
from burncoll.node.dialing import Dialing
from burncoll.node.held import HeldBudget
from burncoll.node.inbox import Inbox
from burncoll.node.lanes import READY, Lanes
from burncoll.node.mailbox import Mailbox
from burncoll.node.membership import (
    Membership,
    NodeInfo,
    TableMismatch,
    explain_lost,
    number_hosts,
)
from burncoll.node.p2p_outbox import Outbox
from burncoll.node.placement import placer_for
from burncoll.node.reading import MemberReader
from burncoll.node.remote_failure import behind, fail_when_done, first_unfinished
from burncoll.protocol.members import Abort, Bye, Status, StatusQuery
from burncoll.transport.base import Buffer, Connection, Listener, Transport
from burncoll.transport.shm import RingReceiver, RingSender
from burncoll.transport.stream_connection import StreamConnection

__all__ = ["DataService"]

log = logging.getLogger("burncoll.node")

#: Seconds a broken connection waits for another node's explanation before blaming the node
#: (1.5, not 0.5: on a loaded machine the failing node's abort came later than that, and a
#: mismatch was reported as a lost node).
_EXPLAIN_GRACE = 1.5


class DataService:
    """Listener plus connections of one node; lives on the node's event loop."""

    def __init__(self, transport: Transport, host: str, port: int, token: str | None,
                 timeout: float, *, integrity: bool = False, lanes: bool = False) -> None:
        self.transport = transport
        self.host = host
        self.requested_port = port
        self.timeout = timeout
        self.membership = Membership()
        self.dialing = Dialing(transport, token, timeout, integrity, self.membership)
        self.connections = MemberConnections()
        #: The caller sockets (:mod:`burncoll.node.lanes`); open only when :attr:`uses_lanes`.
        self.lanes = Lanes()
        self._offers_lanes = lanes
        self._lanes_open = asyncio.Event()
        budget = HeldBudget()  # one for the mailbox and the inbox
        self.mailbox = Mailbox(self.membership.describe, budget=budget)
        self.mailbox.on_error = self.fail
        #: Point-to-point messages received, and sent (awaiting their acknowledgements).
        self.inbox = Inbox(budget=budget)
        self.outbox = Outbox()
        self.reader = MemberReader(self)
        self._listener: Listener | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._telling: asyncio.Task[None] | None = None
        self._statuses: dict[int, Status] = {}
        self._status_event = asyncio.Event()
        self._failed = asyncio.Event()  # set with the session's failure
        #: Another node's failure, held while this node finishes what that node had finished.
        self.held: BaseException | None = None
        self._holding: asyncio.Task[None] | None = None
        #: A member's hello said it holds another table; the members whose hello came in.
        self._table_refused = asyncio.Event()
        self._hellos: set[int] = set()
        self._hellos_in = asyncio.Event()
        #: Called once when the session fails because of another node (set by the link).
        self.on_failure: Callable[[BaseException], None] = lambda error: None
        #: Answers a status query: what this node's peers are doing (its local level's
        #: report, see :class:`~burncoll.protocol.members.Status`).
        self.status: Callable[[], Mapping[str, object]] = lambda: {}

    # -- what the executor and the link read ---------------------------------------------------
    @property
    def session(self) -> int | None:
        return self.membership.session

    @property
    def node_index(self) -> int:
        return self.membership.node_index

    @property
    def nodes(self) -> tuple[NodeInfo, ...]:
        return self.membership.nodes

    @property
    def uses_lanes(self) -> bool:
        """Whether every node of the session offers caller sockets: they are then used."""
        nodes = self.membership.nodes
        return self._offers_lanes and len(nodes) > 1 and all(n.lanes for n in nodes)

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
        self.membership.join(session, node_index, nodes, secret)
        ranks = sorted((p, n.index) for n in self.membership.nodes for p in n.peer_ids)
        self.inbox.join(node_index, [n for _, n in ranks])
        self.connections.expect(len(self.membership.others()))

    # -- connections ---------------------------------------------------------------------------
    async def connect_all(self, deadline: float) -> None:
        """Dial every other node (to receive from it) and wait until every other node has
        dialed this one (to send to it), both by ``deadline``.

        A member whose hello says it holds another node table (:meth:`_serve`) ends it with a
        :class:`~burncoll.MismatchError`, once every other node's hello has come in and this
        node's hellos have gone out (by ``deadline``): each member then finds, on its own,
        some member whose table differs from its own -- no node closes before another could
        tell it apart."""
        others = self.dialing.in_turn(self.membership.others())
        dials = asyncio.ensure_future(asyncio.gather(*(self._connect(n, deadline)
                                                       for n in others)))
        connected = asyncio.ensure_future(self._connected(dials, deadline))
        refused = asyncio.ensure_future(self._table_refused.wait())
        try:
            await asyncio.wait([connected, refused], return_when=asyncio.FIRST_COMPLETED)
            if not refused.done():
                return connected.result()
            hellos = asyncio.ensure_future(self._hellos_in.wait())
            both: list[asyncio.Future[Any]] = [dials, hellos]
            await asyncio.wait(both, timeout=max(deadline - time.monotonic(), 0.01))
            hellos.cancel()
            assert self.mailbox.error is not None  # (set with the refusal)
            raise self.mailbox.error
        finally:
            for task in (connected, refused, dials):
                task.cancel()
            await asyncio.gather(connected, refused, dials, return_exceptions=True)

    async def _connected(self, dials: asyncio.Future[list[None]], deadline: float) -> None:
        await dials
        others = self.membership.others()
        await self._wait_for(self.connections.all_out, deadline, lambda n: (
            n.index in self.connections.out), "")
        if self.uses_lanes:  # the higher-indexed node of each pair dials the caller socket
            me = self.node_index
            await asyncio.gather(*(self._dial_lane(n, deadline)  # (from me - 1 down)
                                   for n in reversed(self.dialing.in_turn(others))
                                   if n.index < me))
            self._check_lanes()
            await self._wait_for(self._lanes_open, deadline, lambda n: (
                n.index in self.lanes.socks), "its caller socket ")

    async def _wait_for(self, event: asyncio.Event, deadline: float,
                        came: Callable[[NodeInfo], bool], what: str) -> None:
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                await event.wait()
        except TimeoutError:
            missing = [n.describe() for n in self.membership.others() if not came(n)]
            raise TransportError(
                f"{', '.join(missing)} did not connect {what}to this node within "
                f"{self.timeout:g} s"
            ) from None

    async def _dial_lane(self, node: NodeInfo, deadline: float) -> None:
        conn = await self.dialing.dial(node, deadline, lane=True)
        try:
            if not isinstance(conn, StreamConnection):  # pragma: no cover - tcp, websocket
                raise TransportError("this transport has no caller sockets")
            sock = conn.detach()
        except (TransportError, ProtocolError) as exc:
            await conn.close()
            raise TransportError(f"the caller socket to {node.describe()}: {exc}") from exc
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                ready = await asyncio.get_running_loop().sock_recv(sock, 1)
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise TransportError(f"{node.describe()} did not open its end of the caller "
                                 f"socket within {self.timeout:g} s") from exc
        except BaseException:  # cancelled: the register failed elsewhere
            sock.close()
            raise
        if ready != READY:
            sock.close()
            raise TransportError(f"{node.describe()} did not open its end of the caller "
                                 "socket (it closed it, or sent something else)")
        self.lanes.add(node.index, sock)

    def _accept_lane(self, node: int, conn: Connection) -> None:
        """``node``'s caller socket: out of the event loop, then :data:`READY`."""
        if not self.uses_lanes or node < self.node_index or node in self.lanes.socks or not (
                isinstance(conn, StreamConnection)):
            raise ProtocolError("a caller socket this node did not expect")
        sock = conn.detach()
        try:
            sock.send(READY)
        except OSError as exc:
            sock.close()
            raise TransportError(f"the caller socket broke: {exc}") from exc
        if not self.lanes.add(node, sock):
            raise ProtocolError("a caller socket after the join (the host mail carries every "
                                "exchange: the lanes' sockets were closed)")
        self._check_lanes()

    def _check_lanes(self) -> None:
        if len(self.lanes.socks) == len(self.membership.others()):
            self._lanes_open.set()

    async def _connect(self, node: NodeInfo, deadline: float) -> None:
        conn = await self.dialing.dial(node, deadline)
        if self._same_host(node.index):
            conn = RingReceiver(conn)
        # Array data arrives only here (the receiving node dials), and only node's.
        self.connections.add_dialed(node.index, conn, placer_for(
            self.mailbox, self.session, node.index))
        reader = asyncio.get_running_loop().create_task(
            self.reader.read(conn, node.index, data=True))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _serve(self, conn: Connection) -> None:
        """An accepted connection: after authentication and ``hello``, this node sends to the
        dialer on it (and still reads it, as every connection)."""
        try:
            accepted = await self.dialing.accept(conn)
        except TableMismatch as exc:
            self.fail(MismatchError(str(exc)), tell=False)  # (each member finds it)
            self._table_refused.set()
            self._said_hello(exc.node)
            return
        if accepted is None:
            return
        node, conn, lane = accepted
        self._said_hello(node)
        if lane:
            try:
                self._accept_lane(node, conn)
            except (ProtocolError, TransportError) as exc:
                log.warning("data service: dropped a caller socket from %s: %s",
                            self.nodes[node].describe(), exc)
                await conn.close()
            return
        if self._same_host(node):
            conn = RingSender(conn)
        if not self.connections.add_out(node, conn):
            log.warning("data service: dropped a second connection from %s",
                        self.nodes[node].describe())
            return
        await self.reader.read(conn, node, data=False)

    def _said_hello(self, node: int) -> None:
        self._hellos.add(node)
        if len(self._hellos) >= len(self.membership.others()):
            self._hellos_in.set()

    def _same_host(self, node: int) -> bool:
        """Whether ``node`` runs on this node's host and every node uses lanes: the two may
        then share host memory (:mod:`burncoll.node.host_memory`), and their connection is
        wrapped to take its stream region at join (:mod:`burncoll.transport.shm`)."""
        hosts = number_hosts(self.membership.nodes)
        return self.uses_lanes and bool(hosts) and hosts[node] == hosts[self.node_index]

    async def send(self, node: int, parts: Sequence[Buffer]) -> None:
        """Send one frame to ``node``; a broken connection fails the session (PeerLost)."""
        if node not in self.connections.out:
            raise PeerLost(f"no connection to {self.nodes[node].describe()}")
        try:
            await self.connections.send(node, parts)
        except TransportError as exc:
            await self.await_explanation()
            self.fail(PeerLost(f"{self.nodes[node].describe()} is unreachable: {exc}"))
            # the session's failure: this one as fail() worded it, or an earlier one
            raise self.mailbox.error or PeerLost(str(exc)) from exc

    async def tell_all(self, message: Abort | Bye, timeout: float = 1.0) -> None:
        """Best effort: send a CONTROL message to every other node, bounded in time."""
        await self.connections.tell(list(self.connections.out), message, self.session or 0,
                                    timeout)

    # -- status queries (for timeout messages) -----------------------------------------------
    async def reply_status(self, node: int) -> None:
        """Answer ``node``'s status query (best effort)."""
        await self.connections.tell([node], Status.of(self.node_index, self.status()),
                                    self.session or 0, 1.0)

    def took_status(self, status: Status, node: int) -> None:
        self._statuses[node] = status
        self._status_event.set()

    async def query_status(self, nodes: Sequence[int], timeout: float) -> dict[int, Status]:
        """Ask ``nodes`` what their peers are doing; whoever answers within ``timeout``."""
        self._statuses = {}
        self._status_event = asyncio.Event()
        await self.connections.tell(nodes, StatusQuery(self.node_index), self.session or 0,
                                    timeout)
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

    # -- failure and shutdown -----------------------------------------------------------------
    def fail(self, error: BaseException, tell: bool = True) -> None:
        """Fail the session here; tell every other node unless the error came from one.

        A :class:`~burncoll.PeerLost` seen here gets what the other nodes need to act on it:
        the operation it interrupted, how far into it, and a hint.
        """
        if self.mailbox.error is not None or (
                self.held not in (None, error) and type(error) is PeerLost):
            return  # (a node lost while another's failure is held: that node, leaving after it)
        if tell and type(error) is PeerLost:
            error = PeerLost(explain_lost(str(error), self.mailbox, self.timeout))
        self.mailbox.fail(error)
        self.inbox.fail(error)
        self.outbox.fail(error)
        self.connections.stop_placing()  # the failed operation's memory is its caller's again
        self.connections.abandon_sends(error)
        self.lanes.wake()
        self._failed.set()
        self.on_failure(error)
        if tell and self.connections.out:
            self._telling = asyncio.get_running_loop().create_task(self.tell_all(
                Abort(self.node_index, type(error).__name__, str(error),
                      first_unfinished(self.status()))))

    def fail_remote(self, error: BaseException, done_before: int | None) -> None:
        """Another node's failure: now, or held until this node has finished what that node
        had (every operation below ``done_before``; :mod:`burncoll.node.remote_failure`)."""
        if done_before is None or not behind(self.status(), done_before):
            self.fail(self.held or error, tell=False)
        elif self.held is None:
            self.held = error
            self._holding = asyncio.get_running_loop().create_task(fail_when_done(
                lambda: self.fail(error, tell=False), self.status, done_before, self.timeout))

    async def flush_abort(self) -> None:
        """Wait until the abort message of a local failure is sent (bounded by tell_all), so
        that the error reaches the other nodes even if this process exits right after."""
        telling = self._telling
        if telling is not None:
            await asyncio.shield(telling)

    async def failure(self) -> BaseException:
        """The session's failure, once it fails."""
        await self._failed.wait()
        return self.mailbox.error or PeerLost("the session was closed")

    async def await_explanation(self) -> None:
        """A connection broke. A node that fails tells the others why and then closes its
        connections: the explanation travels on another connection and may come second, so
        wait a moment for it before a live node is reported lost."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_EXPLAIN_GRACE):
                await self._failed.wait()

    async def close(self) -> None:
        """Say ``bye`` to every node (after the abort, if this node failed the session), then
        close every connection and the listener."""
        self.reader.closing = True
        await self.flush_abort()
        await self.tell_all(Bye(self.node_index))
        await self.connections.close()
        self.lanes.close()
        for reader in list(self._readers):  # one paused by backpressure reads no more
            reader.cancel()
        if self._holding is not None:  # (leaving: no operation waits for the held failure)
            self._holding.cancel()
        if self._listener is not None:
            await self._listener.close()

