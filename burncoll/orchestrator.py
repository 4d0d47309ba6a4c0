"""The GlobalOrchestrator: the rendezvous point of the nodes. It carries no array data.

Protocol (CONTROL frames, JSON, after the token challenge):

* node -> orchestrator ``{"type": "join", "host", "port", "peer_ids", "fingerprint", "meta"}``
  (``meta``: facts about the node that the others need, passed through untouched)
* orchestrator -> node ``{"type": "table", "session", "index", "nodes": [...]}`` once
  ``num_nodes`` consistent nodes have joined (nodes ordered by their lowest peer id), or
  ``{"type": "refused", "reason"}`` naming the difference with the nodes already waiting.
* node -> orchestrator ``{"type": "finish"}``; orchestrator -> every node ``{"type":
  "finished"}`` when every node of the session has finished.
* orchestrator -> node ``{"type": "node_lost", "node"}`` when a member's connection drops
  before it finished, unless it said ``{"type": "leave"}`` first (a node leaving a failed
  collective: the nodes have already told each other why, and it is not dead).

After the table the nodes talk peer to peer; the orchestrator can die without disturbing the
operations under way (only ``finish`` and new registrations need it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from burncoll.config import TRANSPORTS
from burncoll.errors import AuthenticationError, ConfigError, ProtocolError, TransportError
from burncoll.node.loop import IoLoop
from burncoll.transport import TlsSettings, get_transport
from burncoll.transport.auth import authenticate_server
from burncoll.transport.base import Connection, Listener
from burncoll.transport.wire import decode, encode_control

__all__ = ["Orchestrator", "start_orchestrator"]

log = logging.getLogger("burncoll.orchestrator")


@dataclass
class _Member:
    conn: Connection
    host: str
    port: int
    peer_ids: tuple[int, ...]
    fingerprint: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    session: _Session | None = None
    #: Said ``leave``: it leaves a failed collective on purpose (its process is not dead).
    left: bool = False

    @property
    def num_nodes(self) -> int:
        """How many nodes the member's collective has (validated by :func:`_member_from`)."""
        return int(self.fingerprint.get("num_nodes") or 1)


@dataclass
class _Session:
    sid: int
    members: list[_Member]
    finished: set[int] = field(default_factory=set)


class Orchestrator:
    """A running orchestrator; a context manager. ``address`` is ``"host:port"``."""

    def __init__(self, host: str, port: int, transport: str, auth_token: str | None,
                 timeout: float, tls: TlsSettings | None) -> None:
        self._io = IoLoop("burncoll-orchestrator")
        self._transport = get_transport(transport, tls=tls)
        self._token = auth_token
        self._timeout = timeout
        self._pending: list[_Member] = []
        self._listener: Listener | None = None
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
        self.host = self._listener.host
        self.port = self._listener.port

    @property
    def address(self) -> str:
        """``"host:port"`` to put in ``CollectiveConfig.global_address``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        """Stop listening and drop every connection (idempotent)."""
        listener, self._listener = self._listener, None
        if listener is not None:
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
            await authenticate_server(conn, self._token, self._timeout)
        except (AuthenticationError, TransportError) as exc:
            log.warning("orchestrator: refused a connection from %s: %s", conn.remote, exc)
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
                frame = decode(await conn.recv())
                kind = frame.control["type"] if frame.control is not None else None
                if kind == "finish":
                    await self._finish(member)
                elif kind == "leave":
                    member.left = True
                    if member in self._pending:  # gave up waiting: never put it in a session
                        self._pending.remove(member)
        except (ProtocolError, TransportError) as exc:
            if isinstance(exc, ProtocolError):
                log.warning("orchestrator: dropped node %s: it sent a malformed frame: %s",
                            conn.remote, exc)
            await self._gone(member, exc)

    async def _join(self, conn: Connection) -> _Member | None:
        async with asyncio.timeout(self._timeout):
            frame = decode(await conn.recv())
        message = frame.control or {}
        if message.get("type") != "join":
            raise ProtocolError("expected a join message")
        try:
            member = _member_from(conn, message)
            self._check_consistent(member)
        except ConfigError as exc:
            log.warning("orchestrator: refused node %s: %s", conn.remote, exc)
            await conn.send([encode_control({"type": "refused", "reason": str(exc)})])
            return None
        self._pending.append(member)
        if len(self._pending) == member.num_nodes:
            # Take the members before awaiting: a node joining meanwhile waits for the next.
            members, self._pending = self._pending, []
            await self._start_session(members)
        return member

    def _check_consistent(self, member: _Member) -> None:
        for other in self._pending:
            if other.fingerprint != member.fingerprint:
                diffs = [
                    f"{key}: {member.fingerprint.get(key)!r} here, "
                    f"{other.fingerprint.get(key)!r} on the node(s) already waiting"
                    for key in sorted(set(member.fingerprint) | set(other.fingerprint))
                    if member.fingerprint.get(key) != other.fingerprint.get(key)
                ]
                raise ConfigError(
                    "this node's config differs from the nodes already registered: "
                    + "; ".join(diffs)
                )
            overlap = sorted(set(other.peer_ids) & set(member.peer_ids))
            if overlap:
                raise ConfigError(
                    f"peer id(s) {overlap} are already used by the node at "
                    f"{other.host}:{other.port}; peer ids must be unique across nodes"
                )

    async def _start_session(self, members: list[_Member]) -> None:
        session = _Session(secrets.randbits(62) + 1, sorted(members, key=lambda m: min(m.peer_ids)))
        nodes = []
        for index, m in enumerate(session.members):
            m.index = index
            m.session = session
            nodes.append({"index": index, "host": m.host, "port": m.port,
                          "peer_ids": list(m.peer_ids), "meta": m.meta})
        log.info("orchestrator: session %x formed with %d nodes", session.sid, len(nodes))
        for m in session.members:
            await _tell(m, {"type": "table", "session": session.sid, "index": m.index,
                            "nodes": nodes})

    async def _finish(self, member: _Member) -> None:
        session = member.session
        if session is None:
            return
        session.finished.add(member.index)
        if len(session.finished) == len(session.members):
            for m in session.members:
                await _tell(m, {"type": "finished"})

    async def _gone(self, member: _Member, exc: BaseException) -> None:
        if member in self._pending:
            self._pending.remove(member)
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
                await _tell(m, {"type": "node_lost", "node": member.index})


async def _tell(member: _Member, message: dict[str, Any]) -> None:
    try:
        async with asyncio.timeout(2.0):
            await member.conn.send([encode_control(message)])
    except (TransportError, TimeoutError):
        pass


def _is_int(value: object, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high]``."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _member_from(conn: Connection, message: dict[str, Any]) -> _Member:
    """The member a join message describes; :class:`ConfigError` naming what is malformed.

    Everything the orchestrator later relies on is checked here, before the member joins the
    waiting list: a malformed join must be refused, never left waiting to spoil later joins.
    """
    host, port, peer_ids = message.get("host"), message.get("port"), message.get("peer_ids")
    fingerprint = message.get("fingerprint")
    problems = []
    if not isinstance(host, str) or not host:
        problems.append("host must be a non-empty string")
    if not _is_int(port, 1, 65535):
        problems.append("port must be an int in [1, 65535]")
    if not isinstance(peer_ids, list) or not peer_ids or not all(
        _is_int(p, 0) for p in peer_ids
    ) or len(set(peer_ids)) != len(peer_ids):
        problems.append("peer_ids must be a non-empty list of distinct ints >= 0")
    if not isinstance(fingerprint, dict):
        problems.append("fingerprint must be an object")
    elif fingerprint.get("num_nodes") is not None and not _is_int(fingerprint["num_nodes"], 1):
        problems.append("fingerprint.num_nodes must be an int >= 1")
    if problems:
        raise ConfigError(f"malformed join message: {'; '.join(problems)}")
    assert isinstance(host, str) and isinstance(port, int) and isinstance(peer_ids, list)
    assert isinstance(fingerprint, dict)
    meta = message.get("meta")
    return _Member(conn, host, port, tuple(sorted(peer_ids)), fingerprint,
                   meta if isinstance(meta, dict) else {})


def start_orchestrator(
    host: str = "127.0.0.1",
    port: int = 0,
    transport: str = "websocket",
    auth_token: str | None = None,
    *,
    timeout: float = 60.0,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
) -> Orchestrator:
    """Start the rendezvous server on ``host:port`` (0 = a free port) in the background.

    Returns a running :class:`Orchestrator` (a context manager; ``.address`` is
    ``"host:port"``). It binds loopback unless told otherwise. Raises
    :class:`~burncoll.TransportError` naming the port when it cannot be bound.
    """
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
    tls = TlsSettings(tls_cert, tls_key, tls_ca)
    return Orchestrator(host, port, transport, auth_token, timeout, tls)
