"""The GlobalOrchestrator: the rendezvous point of the nodes. It carries no array data.

After the token challenge a node sends ``join`` (or ``abandon``, having failed before it could
join); the messages are the dataclasses of :mod:`burncoll.protocol.control`. Registrations wait
in groups keyed by their config fingerprint (:mod:`burncoll.orchestration.waiting`, bounded);
a group of ``num_nodes`` members becomes a session and each member gets the ``table`` (with a
fresh 32-byte session secret). A registration whose config differs from a waiting group's is,
**with a token** (a misconfigured job), refused at once naming each field that differs, and the
waiting group is told ``abandoned``; **without a token** (anyone local can register) it waits
in its own group, both sides get a ``notice`` of the differences, and a stranger with
``num_nodes=99`` cannot lock the real nodes out. ``expected_nodes`` refuses any other
``num_nodes``. After the table the nodes talk peer to peer: only ``finish`` (answered
``finished``) and ``node_lost`` (a member dropped without ``leave``) still pass through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from burncoll.config.security import check_bind_address, check_tls_mode, check_token
from burncoll.errors import AuthenticationError, ConfigError, ProtocolError, TransportError
from burncoll.ioloop import IoLoop
from burncoll.orchestration.waiting import (
    MAX_WAITING,
    Conflict,
    Group,
    Member,
    Session,
    WaitingRoom,
)
from burncoll.protocol.control import (
    MAX_REASON,
    Abandon,
    Abandoned,
    Finish,
    Finished,
    Join,
    Leave,
    NodeLost,
    Notice,
    Refused,
    decode_from_node,
    encode,
    kind_of,
)
from burncoll.protocol.fields import MalformedMessage, canonical, is_int
from burncoll.protocol.wire import CONTROL_LIMIT, decode
from burncoll.transport import TRANSPORT_NAMES, TlsSettings, get_transport
from burncoll.transport.admission import BoundedLog
from burncoll.transport.auth import authenticate_server
from burncoll.transport.base import Connection, Listener, tell

__all__ = ["Orchestrator", "start_orchestrator"]

log = logging.getLogger("burncoll.orchestrator")
#: For what a stranger can cause at will (refused connections): bounded, see BoundedLog.
stranger_log = BoundedLog(log)

#: Largest message the orchestrator accepts: a CONTROL frame (JSON) and its header, integrity
#: tag included.
ORCHESTRATOR_MESSAGE_BYTES = CONTROL_LIMIT + 4096
#: Seconds an authenticated connection has to send its join message.
JOIN_SECONDS = 10.0
#: Seconds a message to one node may take before that node is given up on (best effort).
_TELL_SECONDS = 2.0


class Orchestrator:
    """A running orchestrator; a context manager. ``address`` is ``"host:port"``."""

    def __init__(self, host: str, port: int, transport: str, auth_token: str | None,
                 timeout: float, tls: TlsSettings | None, *, integrity: bool = False,
                 expected_nodes: int | None = None, min_nodes: int | None = None,
                 min_nodes_wait: float = 30.0) -> None:
        self._io = IoLoop("burncoll-orchestrator")
        # Only CONTROL messages ever come here: no connection may announce more.
        self._transport = get_transport(transport, tls=tls,
                                        max_message_bytes=ORCHESTRATOR_MESSAGE_BYTES)
        self._token = auth_token
        self._timeout = timeout
        self._integrity = integrity
        self._room = WaitingRoom(auth_token is not None, expected_nodes)
        self._min_nodes = min_nodes
        self._min_nodes_wait = min_nodes_wait
        #: the group whose partial session is scheduled, by config key, and its timer
        self._last_calls: dict[str, tuple[Group, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._telling_finished = 0  # sessions whose ``finished`` messages are being sent
        self._ended: str | None = None  # why no session may form any more (node_failed)
        self._listener: Listener | None = None
        #: The transport nodes reach it by: ``"websocket"``, ``"quic"`` or ``"tcp"``.
        self.transport = transport
        try:
            self._listener = self._io.submit(
                self._transport.listen(host, port, self._serve)).result(timeout + 5)
        except TransportError as exc:
            self._io.stop()
            raise TransportError(
                f"the orchestrator {exc}; choose another port (--port, or 0 for a free one)"
            ) from exc
        except BaseException:
            self._io.stop()
            raise
        #: The address it listens on.
        self.host = self._listener.host
        #: The port it listens on (the one chosen when it was asked for port 0).
        self.port = self._listener.port

    @property
    def address(self) -> str:
        """``"host:port"`` to put in ``CollectiveConfig.global_address``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self, drain: float = 0.0) -> None:
        """Stop listening and drop every connection (idempotent).

        ``drain``: seconds to wait first for ``finished`` messages on their way to nodes (a
        node that hosts the orchestrator may hear its own ``finished`` and exit before the
        others have been told).
        """
        listener, self._listener = self._listener, None
        if listener is not None:
            if drain > 0:
                with contextlib.suppress(Exception):
                    self._io.submit(self._drain(drain)).result(drain + 1)
            try:
                self._io.submit(listener.close()).result(5)
            except Exception:  # pragma: no cover - best effort on shutdown
                log.debug("orchestrator: error while closing", exc_info=True)
        self._io.stop()

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one node's connection ------------------------------------------------------------------
    async def _serve(self, conn: Connection) -> None:
        try:
            conn = await authenticate_server(conn, self._token, self._timeout,
                                             integrity=self._integrity)
        except (AuthenticationError, TransportError) as exc:
            stranger_log.warning("refused", f"orchestrator: refused a connection from "
                                 f"{conn.remote}: {exc}")
            return
        try:
            member = await self._join(conn)
        except (ProtocolError, TransportError, TimeoutError) as exc:
            log.warning("orchestrator: dropped %s: %s", conn.remote, exc)
            return
        if member is None:
            return
        try:
            while True:
                message = decode_from_node(decode(await conn.recv()))
                if isinstance(message, Finish):
                    await self._finish(member)
                elif isinstance(message, Leave):
                    member.left = True
                    self._room.unwait(member)  # gave up waiting: never put it in a session
        except (ProtocolError, TransportError) as exc:
            if isinstance(exc, ProtocolError):
                log.warning("orchestrator: dropped node %s: it sent a malformed frame: %s",
                            conn.remote, exc)
            await self._gone(member, exc)

    async def _join(self, conn: Connection) -> Member | None:
        async with asyncio.timeout(min(self._timeout, JOIN_SECONDS)):
            frame = decode(await conn.recv())
        if kind_of(frame) == Abandon.KIND:
            try:
                await self._abandoned(Abandon.from_json(frame.control or {}))
            except MalformedMessage as exc:
                log.warning("orchestrator: ignored a malformed abandon message from %s: %s",
                            conn.remote, exc)
            return None
        if kind_of(frame) != Join.KIND:
            raise ProtocolError("expected a join message")
        if self._ended is not None:  # (see node_failed)
            await tell(conn, Abandoned("CollectiveError", self._ended), _TELL_SECONDS)
            return None
        try:
            member = Member.of(conn, Join.from_json(frame.control or {}))
            full = self._room.admit(member)
        except (MalformedMessage, ConfigError) as exc:
            log.warning("orchestrator: refused node %s: %s", conn.remote, exc)
            await conn.send([encode(Refused(str(exc)))])
            if isinstance(exc, Conflict):
                await self._tell_group(exc)
            return None
        if full is not None:
            self._cancel_last_call(member.key)
            await self._start_session(full)
        else:
            self._maybe_last_call(member.key)
            for m, notice in self._room.notices(member):
                await tell(m.conn, notice, _TELL_SECONDS)
        return member

    async def _tell_group(self, conflict: Conflict) -> None:
        """The group a refused newcomer conflicts with learns it at once: with a token (the
        job is misconfigured) it fails too; without one the newcomer may be a stranger, so
        only the node whose peer ids it claimed gets a notice (its timeout error shows it)."""
        if self._room.refuse_differences:
            await self._fail_waiting(conflict.group, "ConfigError", conflict.their_reason)
        elif conflict.holder is not None:
            await tell(conflict.holder.conn, Notice(conflict.their_reason), _TELL_SECONDS)

    async def _abandoned(self, message: Abandon) -> None:
        """A node failed before it could join: the nodes waiting for it (its config's group)
        fail at once with its error. Who may say so: any connection that authenticated, so
        with a token only the job's own processes; without one, any local process, which could
        end the forming session anyway (by joining in the missing nodes' place and leaving).
        Elastic (``min_nodes``): the others go on without it, so they only get a notice."""
        group = self._room.groups.get(canonical(message.fingerprint))
        reason = (f"node {message.node} (peer ids {list(message.peer_ids[:16])}, pid "
                  f"{message.pid}) failed before this collective formed, so it cannot form: "
                  f"{message.reason}")
        log.warning("orchestrator: %s", reason)
        if group is not None and self._min_nodes is None:
            await self._fail_waiting(group, message.error, reason)
        elif group is not None:  # elastic: the others go on without it, told only
            for m in [m for m in group.members if m.may_notice("failed")]:
                await tell(m.conn, Notice(reason), _TELL_SECONDS)

    def node_failed(self, reason: str) -> None:
        """A node process of this orchestrator's job failed and will not be restarted (its
        launcher, in its last round, saw it exit): every node waiting here, and every node
        that registers from now on, fails at once with ``reason`` (a
        :class:`~burncoll.CollectiveError`) instead of waiting out its timeout. Blocking, a few
        seconds at most; best effort."""
        async def each() -> None:
            self._ended = reason[:2 * MAX_REASON]
            for group in list(self._room.groups.values()):
                await self._fail_waiting(group, "CollectiveError", self._ended)

        with contextlib.suppress(Exception):  # the launcher reports the failure anyway
            self._io.submit(each()).result(_TELL_SECONDS + 1)

    async def _fail_waiting(self, group: Group, error: str, reason: str) -> None:
        """Every member of ``group`` leaves the waiting room, told ``Abandoned``."""
        members = list(group.members)
        for m in members:
            self._room.unwait(m)
            m.left = True  # refused, not lost: its connection's end is no news
        await asyncio.gather(*(tell(m.conn, Abandoned(error, reason), _TELL_SECONDS)
                               for m in members))

    def _maybe_last_call(self, key: str) -> None:
        """Elastic (``min_nodes``): once a group holds ``min_nodes`` members, the others get
        ``min_nodes_wait`` seconds more to join; then the session forms without them. The
        timer belongs to that group: one that fills or empties first leaves it without effect
        on the next group of the same config (the next round after a restart)."""
        group = self._room.groups.get(key)
        if self._min_nodes is None or group is None or len(group.members) < self._min_nodes:
            return
        pending = self._last_calls.get(key)
        if pending is not None and pending[0] is group:
            return
        if pending is not None:
            pending[1].cancel()
        loop = asyncio.get_running_loop()
        handle = loop.call_later(self._min_nodes_wait, self._spawn_last_call, key, group)
        self._last_calls[key] = (group, handle)

    def _spawn_last_call(self, key: str, group: Group) -> None:
        task = asyncio.get_running_loop().create_task(self._last_call(key, group))
        self._tasks.add(task)  # a reference, so the task is not collected while it runs
        task.add_done_callback(self._tasks.discard)

    def _cancel_last_call(self, key: str) -> None:
        pending = self._last_calls.pop(key, None)
        if pending is not None:
            pending[1].cancel()

    async def _last_call(self, key: str, group: Group) -> None:
        if self._last_calls.get(key, (None,))[0] is group:
            del self._last_calls[key]
        if self._room.groups.get(key) is not group:
            return  # it filled (a full session formed) or emptied meanwhile
        members = self._room.take_partial(key, self._min_nodes or 1)
        if members is None:
            return  # members left meanwhile: the next join arms the timer again
        log.warning("orchestrator: %d of %d nodes joined within %g s; the session goes on "
                    "without the others (min_nodes=%d)", len(members), members[0].num_nodes,
                    self._min_nodes_wait, self._min_nodes or 1)
        await self._start_session(members)

    async def _start_session(self, members: list[Member]) -> None:
        session = Session.form(members)
        log.info("orchestrator: session %x formed with %d nodes", session.sid,
                 len(session.members))
        tables = session.tables()
        await asyncio.gather(*(tell(m.conn, tables[m.index], _TELL_SECONDS)
                               for m in session.members))

    async def _finish(self, member: Member) -> None:
        session = member.session
        if session is not None and session.finish(member):
            self._telling_finished += 1
            try:
                await asyncio.gather(*(tell(m.conn, Finished(), _TELL_SECONDS)
                                       for m in session.members))
            finally:
                self._telling_finished -= 1

    async def _drain(self, seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while self._telling_finished and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)

    async def _gone(self, member: Member, exc: BaseException) -> None:
        if self._room.unwait(member):
            log.info("orchestrator: a waiting node left (%s)", exc)
            return
        session = member.session
        if session is None or member.index in session.finished:
            return
        if member.left:
            # it left a failed collective; the nodes told each other why, directly
            log.info("orchestrator: node %d of session %x left after a failure", member.index,
                     session.sid)
            return
        log.warning("orchestrator: node %d of session %x lost: %s", member.index, session.sid,
                    exc)
        for m in session.members:
            if m is not member and m.index not in session.finished:
                await tell(m.conn, NodeLost(member.index), _TELL_SECONDS)


def start_orchestrator(host: str = "127.0.0.1", port: int = 0, transport: str = "websocket",
                       auth_token: str | None = None, *, timeout: float = 60.0,
                       tls_cert: str | None = None, tls_key: str | None = None,
                       tls_ca: str | None = None, tls: bool | None = None, integrity: bool = False,
                       insecure: bool = False, expected_nodes: int | None = None,
                       min_nodes: int | None = None, min_nodes_wait: float = 30.0) -> Orchestrator:
    """Start the rendezvous server on ``host:port`` (0 = a free port) in the background.

    Returns a running :class:`Orchestrator` (a context manager; ``.address`` is
    ``"host:port"``). It binds loopback unless told otherwise; a non-loopback ``host`` needs
    an ``auth_token`` or ``insecure=True`` (:class:`~burncoll.ConfigError` otherwise).
    ``tls``, ``integrity``: as the :class:`~burncoll.CollectiveConfig` fields of the same
    names, which every node must match. ``expected_nodes``: refuse registrations of any other
    ``num_nodes``. ``min_nodes`` (elastic, as torchrun's ``--nnodes MIN:MAX``): once that many
    nodes of a collective have joined, the others get ``min_nodes_wait`` seconds more, then
    the session forms without them (its table is smaller than ``num_nodes``). Raises
    :class:`~burncoll.TransportError` naming the port when it cannot be bound.
    """
    if transport not in TRANSPORT_NAMES:
        raise ConfigError(f"transport={transport!r}: expected one of {', '.join(TRANSPORT_NAMES)}")
    if expected_nodes is not None and not is_int(expected_nodes, 1, MAX_WAITING):
        raise ConfigError(f"expected_nodes={expected_nodes!r}: expected an int in "
                          f"[1, {MAX_WAITING}] or None")
    if min_nodes is not None and not is_int(min_nodes, 1, expected_nodes or MAX_WAITING):
        raise ConfigError(f"min_nodes={min_nodes!r}: expected an int in [1, expected_nodes] "
                          "or None")
    if isinstance(min_nodes_wait, bool) or not (
            isinstance(min_nodes_wait, int | float) and min_nodes_wait > 0):
        raise ConfigError(f"min_nodes_wait={min_nodes_wait!r}: expected seconds > 0")
    check_token(auth_token, "the orchestrator's auth token")
    check_bind_address(host, auth_token, insecure, f"the orchestrator's host {host!r}",
                       "--insecure (insecure=True)")
    check_tls_mode(transport, tls, (tls_cert, tls_key, tls_ca))
    settings = TlsSettings(tls_cert, tls_key, tls_ca, ephemeral=bool(tls))
    return Orchestrator(host, port, transport, auth_token, timeout, settings,
                        integrity=integrity, expected_nodes=expected_nodes,
                        min_nodes=min_nodes, min_nodes_wait=min_nodes_wait)
