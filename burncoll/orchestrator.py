"""The GlobalOrchestrator: the rendezvous point of the nodes. It carries no array data.

Protocol (CONTROL frames, JSON, after the token challenge):

* node -> orchestrator ``{"type": "join", "host", "port", "peer_ids", "fingerprint", "meta"}``
  (``meta``: facts about the node that the others need, passed through untouched)
* orchestrator -> node ``{"type": "table", "session", "index", "nodes": [...], "secret"}``
  once ``num_nodes`` nodes with the same fingerprint have joined (nodes ordered by their
  lowest peer id); ``secret`` is 32 random bytes (hex), fresh for each session and sent to its
  members only, which they may use to authenticate each other's connections when no token is
  set. Or ``{"type": "refused", "reason"}`` saying why the node cannot join.
* orchestrator -> node ``{"type": "notice", "reason"}`` while it waits: other nodes are waiting
  whose config differs from this one's (at most :data:`MAX_NOTICES` per node; informational).
* node -> orchestrator ``{"type": "finish"}``; orchestrator -> every node ``{"type":
  "finished"}`` when every node of the session has finished.
* orchestrator -> node ``{"type": "node_lost", "node"}`` when a member's connection drops
  before it finished, unless it said ``{"type": "leave"}`` first (a node leaving a failed
  collective: the nodes have already told each other why, and it is not dead).

Who waits with whom. Waiting registrations are grouped by their config fingerprint
(:meth:`burncoll.CollectiveConfig.global_fingerprint`); a group becomes a session when it
holds its ``num_nodes`` members. Peer ids must be unique within a group (a duplicate is
refused). What happens to a registration whose fingerprint differs from a group already
waiting depends on whether the orchestrator has a token:

* **With a token**, every registration comes from a process that holds it, so a difference is
  a genuine misconfiguration: the newcomer is refused at once, the message naming each field
  that differs (``transport: 'quic' here, 'websocket' on the node(s) already waiting``).
* **Without a token** (loopback only, unless ``insecure``) anyone on the machine can register,
  so a difference is no reason to refuse: a stranger that arrives first with ``num_nodes=99``
  must not lock the real nodes out. The newcomer waits in its own group, and both sides get a
  ``notice`` naming the differences, which a node includes in its registration timeout error
  -- what a user who misconfigured one node needs to see.

``expected_nodes`` (``burncoll orchestrator --nodes N``; ``burncoll launch`` sets it) refuses
any other ``num_nodes`` at once. State is bounded: at most :data:`MAX_WAITING` registrations
and :data:`MAX_WAITING_PEERS` peer ids wait at once, a node registers at most
:data:`MAX_NODE_PEERS` peer ids, and its fingerprint and meta are at most
:data:`MAX_FIELD_BYTES` bytes of JSON each; beyond, a join is refused with a logged reason. A
waiting node whose connection closes (or that says ``leave``) is forgotten.

After the table the nodes talk peer to peer; the orchestrator can die without disturbing the
operations under way (only ``finish`` and new registrations need it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from burncoll.secure_defaults import check_bind_address, check_tls_mode, check_token
from burncoll.errors import AuthenticationError, ConfigError, ProtocolError, TransportError
from burncoll.ioloop import IoLoop
from burncoll.transport import TRANSPORT_NAMES, TlsSettings, get_transport
from burncoll.transport.admission import BoundedLog
from burncoll.transport.auth import authenticate_server
from burncoll.transport.base import Connection, Listener
from burncoll.transport.wire import CONTROL_LIMIT, decode, encode_control

__all__ = [
    "MAX_FIELD_BYTES",
    "MAX_NODE_PEERS",
    "MAX_NOTICES",
    "MAX_WAITING",
    "MAX_WAITING_PEERS",
    "Orchestrator",
    "start_orchestrator",
]

log = logging.getLogger("burncoll.orchestrator")
#: For what a stranger can cause at will (refused connections): bounded, see BoundedLog.
stranger_log = BoundedLog(log)

#: Largest message the orchestrator accepts: a CONTROL frame (JSON) and its header, integrity
#: tag included.
ORCHESTRATOR_MESSAGE_BYTES = CONTROL_LIMIT + 4096

#: Most registrations waiting at once, all groups together (a session needs at most this many
#: nodes). Each costs a connection plus at most a few tens of KiB of state.
MAX_WAITING = 1024
#: Most peer ids one node may register (devices on one node).
MAX_NODE_PEERS = 4096
#: Most peer ids waiting at once, all nodes together; also bounds a table message's size.
MAX_WAITING_PEERS = 65536
#: Largest fingerprint, and largest meta, kept per node (bytes of canonical JSON).
MAX_FIELD_BYTES = 4096
#: Most ``notice`` messages one waiting node is sent.
MAX_NOTICES = 4
#: Seconds an authenticated connection has to send its join message.
JOIN_SECONDS = 10.0
_MAX_HOST = 255
_MAX_PEER_ID = 2**63 - 1


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
    group: _Group | None = None
    #: Said ``leave``: it leaves a failed collective on purpose (its process is not dead).
    left: bool = False
    #: Groups this member was told about in a ``notice``.
    noticed: set[str] = field(default_factory=set)

    @property
    def num_nodes(self) -> int:
        """How many nodes the member's collective has (validated by :func:`_member_from`)."""
        return int(self.fingerprint.get("num_nodes") or 1)

    @property
    def key(self) -> str:
        """The canonical spelling of the fingerprint: members with the same key group."""
        return _canonical(self.fingerprint)


@dataclass
class _Group:
    """Registrations with one fingerprint, waiting for ``num_nodes`` of them."""

    key: str
    num_nodes: int
    fingerprint: dict[str, Any]
    members: list[_Member] = field(default_factory=list)
    peer_ids: set[int] = field(default_factory=set)


@dataclass
class _Session:
    sid: int
    members: list[_Member]
    secret: str
    finished: set[int] = field(default_factory=set)


class Orchestrator:
    """A running orchestrator; a context manager. ``address`` is ``"host:port"``."""

    def __init__(self, host: str, port: int, transport: str, auth_token: str | None,
                 timeout: float, tls: TlsSettings | None, *, integrity: bool = False,
                 expected_nodes: int | None = None) -> None:
        self._io = IoLoop("burncoll-orchestrator")
        # Only CONTROL messages ever come here: no connection may announce more.
        self._transport = get_transport(transport, tls=tls,
                                        max_message_bytes=ORCHESTRATOR_MESSAGE_BYTES)
        self._token = auth_token
        self._timeout = timeout
        self._integrity = integrity
        self._expected_nodes = expected_nodes
        self._groups: dict[str, _Group] = {}
        self._waiting = 0
        self._waiting_peers = 0
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
                frame = decode(await conn.recv())
                kind = frame.control["type"] if frame.control is not None else None
                if kind == "finish":
                    await self._finish(member)
                elif kind == "leave":
                    member.left = True
                    self._unwait(member)  # gave up waiting: never put it in a session
        except (ProtocolError, TransportError) as exc:
            if isinstance(exc, ProtocolError):
                log.warning("orchestrator: dropped node %s: it sent a malformed frame: %s",
                            conn.remote, exc)
            await self._gone(member, exc)

    async def _join(self, conn: Connection) -> _Member | None:
        async with asyncio.timeout(min(self._timeout, JOIN_SECONDS)):
            frame = decode(await conn.recv())
        message = frame.control or {}
        if message.get("type") != "join":
            raise ProtocolError("expected a join message")
        try:
            member = _member_from(conn, message)
            group = self._admit(member)
        except ConfigError as exc:
            log.warning("orchestrator: refused node %s: %s", conn.remote, exc)
            await conn.send([encode_control({"type": "refused", "reason": str(exc)})])
            return None
        if len(group.members) == group.num_nodes:
            # Take the members before awaiting: a node joining meanwhile waits for the next.
            members = list(group.members)
            for m in members:
                self._unwait(m)
            await self._start_session(members)
        else:
            await self._tell_differences(member, group)
        return member

    def _admit(self, member: _Member) -> _Group:
        """Put ``member`` in its group; :class:`ConfigError` saying why it cannot wait."""
        self._check_limits(member)
        key = member.key
        if self._token is not None:
            for other in self._groups.values():
                if other.key != key:
                    raise ConfigError(
                        "this node's config differs from the nodes already registered: "
                        + _differences(member.fingerprint, other.fingerprint)
                    )
        group = self._groups.get(key)
        if group is None:
            group = _Group(key, member.num_nodes, member.fingerprint)
        overlap = sorted(group.peer_ids.intersection(member.peer_ids))
        if overlap:
            holder = next(m for m in group.members if set(m.peer_ids) & set(overlap))
            raise ConfigError(
                f"peer id(s) {overlap[:16]} are already used by the node at "
                f"{holder.host}:{holder.port}; peer ids must be unique across nodes"
            )
        self._groups[key] = group
        group.members.append(member)
        group.peer_ids.update(member.peer_ids)
        member.group = group
        self._waiting += 1
        self._waiting_peers += len(member.peer_ids)
        return group

    def _check_limits(self, member: _Member) -> None:
        expected = self._expected_nodes
        if expected is not None and member.num_nodes != expected:
            raise ConfigError(
                f"this orchestrator serves a collective of {expected} nodes (--nodes "
                f"{expected}), and this node says num_nodes={member.num_nodes}; set num_nodes "
                f"(BURNCOLL_NUM_NODES) to {expected}"
            )
        if member.num_nodes > MAX_WAITING:
            raise ConfigError(
                f"num_nodes={member.num_nodes} is more than the orchestrator's limit of "
                f"{MAX_WAITING} nodes per collective"
            )
        if self._waiting >= MAX_WAITING:
            raise ConfigError(
                f"the orchestrator already has {self._waiting} nodes waiting (its limit); try "
                "again later, and check that no stranger is flooding it (set an auth token)"
            )
        if self._waiting_peers + len(member.peer_ids) > MAX_WAITING_PEERS:
            raise ConfigError(
                f"the orchestrator already has {self._waiting_peers} peer ids waiting (its "
                f"limit is {MAX_WAITING_PEERS}); try again later, and check that no stranger "
                "is flooding it (set an auth token)"
            )

    def _unwait(self, member: _Member) -> bool:
        """Take ``member`` out of its waiting group; whether it was waiting."""
        group, member.group = member.group, None
        if group is None:
            return False
        group.members.remove(member)
        group.peer_ids.difference_update(member.peer_ids)
        self._waiting -= 1
        self._waiting_peers -= len(member.peer_ids)
        if not group.members and self._groups.get(group.key) is group:
            del self._groups[group.key]
        return True

    async def _tell_differences(self, member: _Member, group: _Group) -> None:
        """Notices between ``member`` and the waiting groups whose fingerprint differs: an
        informational message, at most :data:`MAX_NOTICES` per member (so a flood of
        registrations costs each waiting node a few small messages), never a refusal."""
        for other in [g for g in self._groups.values() if g is not group]:
            if _may_notice(member, other.key):
                diffs = _differences(member.fingerprint, other.fingerprint)
                await _tell(member, {"type": "notice", "reason": (
                    f"{len(other.members)} other node(s) wait at the orchestrator with a config "
                    f"that differs from this node's ({diffs}); they will not join this "
                    "collective: if they are yours, make the configs agree")})
            told = [m for m in list(other.members) if _may_notice(m, group.key)]
            if told:
                mirrored = _differences(other.fingerprint, member.fingerprint)
                notice = {"type": "notice", "reason": (
                    f"another node waits at the orchestrator with a config that differs from "
                    f"this node's ({mirrored}); it will not join this collective: if it is "
                    "yours, make the configs agree")}
                for m in told:
                    await _tell(m, notice)

    async def _start_session(self, members: list[_Member]) -> None:
        session = _Session(secrets.randbits(62) + 1,
                           sorted(members, key=lambda m: min(m.peer_ids)),
                           secrets.token_bytes(32).hex())
        nodes = []
        for index, m in enumerate(session.members):
            m.index = index
            m.session = session
            nodes.append({"index": index, "host": m.host, "port": m.port,
                          "peer_ids": list(m.peer_ids), "meta": m.meta})
        log.info("orchestrator: session %x formed with %d nodes", session.sid, len(nodes))
        for m in session.members:
            await _tell(m, {"type": "table", "session": session.sid, "index": m.index,
                            "nodes": nodes, "secret": session.secret})

    async def _finish(self, member: _Member) -> None:
        session = member.session
        if session is None:
            return
        session.finished.add(member.index)
        if len(session.finished) == len(session.members):
            for m in session.members:
                await _tell(m, {"type": "finished"})

    async def _gone(self, member: _Member, exc: BaseException) -> None:
        if self._unwait(member):
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


def _may_notice(member: _Member, key: str) -> bool:
    """Whether ``member`` may still be told about group ``key`` (once each, a few in all)."""
    if key in member.noticed or len(member.noticed) >= MAX_NOTICES:
        return False
    member.noticed.add(key)
    return True


def _differences(here: dict[str, Any], there: dict[str, Any]) -> str:
    """``"key: X here, Y on the node(s) already waiting; ..."`` for each differing field."""
    return "; ".join(
        f"{key}: {here.get(key)!r} here, {there.get(key)!r} on the node(s) already waiting"
        for key in sorted(set(here) | set(there))
        if here.get(key) != there.get(key)
    )


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _is_int(value: object, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high]``."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _member_from(conn: Connection, message: dict[str, Any]) -> _Member:
    """The member a join message describes; :class:`ConfigError` naming what is malformed.

    Everything the orchestrator later relies on is checked here, before the member joins the
    waiting list: a malformed join must be refused, never left waiting to spoil later joins;
    and nothing larger than the limits of the module docstring is kept.
    """
    host, port, peer_ids = message.get("host"), message.get("port"), message.get("peer_ids")
    fingerprint, meta = message.get("fingerprint"), message.get("meta")
    problems = []
    if not isinstance(host, str) or not host or len(host) > _MAX_HOST:
        problems.append(f"host must be a non-empty string of at most {_MAX_HOST} characters")
    if not _is_int(port, 1, 65535):
        problems.append("port must be an int in [1, 65535]")
    if not isinstance(peer_ids, list) or not peer_ids or len(peer_ids) > MAX_NODE_PEERS or not all(
        _is_int(p, 0, _MAX_PEER_ID) for p in peer_ids
    ) or len(set(peer_ids)) != len(peer_ids):
        problems.append(f"peer_ids must be a non-empty list of at most {MAX_NODE_PEERS} "
                        "distinct ints >= 0")
    if not isinstance(fingerprint, dict):
        problems.append("fingerprint must be an object")
    elif len(_canonical(fingerprint)) > MAX_FIELD_BYTES:
        problems.append(f"fingerprint must be at most {MAX_FIELD_BYTES} bytes of JSON")
    elif fingerprint.get("num_nodes") is not None and not _is_int(fingerprint["num_nodes"], 1):
        problems.append("fingerprint.num_nodes must be an int >= 1")
    if meta is not None and not isinstance(meta, dict):
        meta = None  # passed through untouched when it is an object; otherwise dropped
    if meta is not None and len(_canonical(meta)) > MAX_FIELD_BYTES:
        problems.append(f"meta must be at most {MAX_FIELD_BYTES} bytes of JSON")
    if problems:
        raise ConfigError(f"malformed join message: {'; '.join(problems)}")
    assert isinstance(host, str) and isinstance(port, int) and isinstance(peer_ids, list)
    assert isinstance(fingerprint, dict)
    return _Member(conn, host, port, tuple(sorted(peer_ids)), fingerprint, meta or {})


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
    tls: bool | None = None,
    integrity: bool = False,
    insecure: bool = False,
    expected_nodes: int | None = None,
) -> Orchestrator:
    """Start the rendezvous server on ``host:port`` (0 = a free port) in the background.

    Returns a running :class:`Orchestrator` (a context manager; ``.address`` is
    ``"host:port"``). It binds loopback unless told otherwise; a non-loopback ``host`` needs
    an ``auth_token`` or ``insecure=True`` (:class:`~burncoll.ConfigError` otherwise).
    ``tls``, ``integrity``: as the :class:`~burncoll.CollectiveConfig` fields of the same
    names, which every node must match. ``expected_nodes``: refuse registrations of any other
    ``num_nodes``. Raises :class:`~burncoll.TransportError` naming the port when it cannot be
    bound.
    """
    if transport not in TRANSPORT_NAMES:
        raise ConfigError(f"transport={transport!r}: expected one of {', '.join(TRANSPORT_NAMES)}")
    if expected_nodes is not None and not _is_int(expected_nodes, 1, MAX_WAITING):
        raise ConfigError(f"expected_nodes={expected_nodes!r}: expected an int in "
                          f"[1, {MAX_WAITING}] or None")
    check_token(auth_token, "the orchestrator's auth token")
    check_bind_address(host, auth_token, insecure, f"the orchestrator's host {host!r}",
                       "--insecure (insecure=True)")
    check_tls_mode(transport, tls, (tls_cert, tls_key, tls_ca))
    settings = TlsSettings(tls_cert, tls_key, tls_ca, ephemeral=bool(tls))
    return Orchestrator(host, port, transport, auth_token, timeout, settings,
                        integrity=integrity, expected_nodes=expected_nodes)
