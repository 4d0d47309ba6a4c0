"""Control messages: the JSON objects of CONTROL frames, as frozen dataclasses.

A node sends the orchestrator :class:`Join` (or :class:`Abandon`), :class:`Finish`,
:class:`Leave`; the orchestrator answers :class:`Table`, :class:`Refused`, :class:`Abandoned`,
:class:`Notice`, :class:`Finished`, :class:`NodeLost`. The members' messages
(:mod:`burncoll.protocol.members`) build on the frame, shapes and decoding here. Each message
encodes to the same bytes as before these types existed. Decoding checks every field and
raises :class:`~burncoll.protocol.fields.MalformedMessage` naming each wrong one; a type the
receiver does not expect decodes to ``None`` (ignored). JSON only, nothing unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Self, TypeAlias, TypeVar

from burncoll.protocol.fields import Fields, JsonObject, is_int
from burncoll.protocol.wire import Frame, control_frame, encode_control

__all__ = ["MAX_FIELD_BYTES", "MAX_NODE_PEERS", "MAX_PEER_ID", "MAX_REASON", "MAX_SESSION",
           "Abandon", "Abandoned", "AboutNode", "ControlMessage", "Finish", "Finished", "FromNode",
           "FromOrchestrator", "Join", "Leave", "NodeLost", "Notice", "Refused", "Table",
           "TableEntry", "decode_by_type", "decode_from_node", "decode_from_orchestrator", "encode",
           "kind_of"]

#: Most peer ids one node may register (devices on one node).
MAX_NODE_PEERS = 4096
#: Largest fingerprint, and largest meta, of a join (bytes of canonical JSON).
MAX_FIELD_BYTES = 4096
_MAX_HOST = 255
#: Largest peer id: it travels as an i64 (a DATA header's root).
MAX_PEER_ID = 2**63 - 1
#: Largest session id: it travels as a u64.
MAX_SESSION = 2**64 - 1
#: Longest reason a node gives for failing before it joined (characters; it is cut to fit).
MAX_REASON = 2000
#: Longest name of an error class in a message.
_MAX_ERROR_NAME = 40
_SECRET_HEX = 64  # a session secret: 32 random bytes, in hex
M = TypeVar("M")


class ControlMessage(Protocol):
    """What every message here offers: its JSON object (``"type"`` first)."""

    def to_json(self) -> JsonObject: ...


def encode(message: ControlMessage, session: int = 0) -> bytes:
    """A whole CONTROL frame carrying ``message``."""
    return encode_control(message.to_json(), session)


def kind_of(frame: Frame) -> str | None:
    """The ``"type"`` of a CONTROL frame; ``None`` for a DATA frame (for error messages)."""
    return None if frame.control is None else str(frame.control["type"])


# -- the shapes several messages share -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Bare:
    """A message that is its type alone."""

    KIND: ClassVar[str]

    def to_json(self) -> JsonObject:
        return {"type": self.KIND}

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class AboutNode:
    """A message whose one field is the node it comes from, or is about."""

    KIND: ClassVar[str]
    node: int

    def to_json(self) -> JsonObject:
        return {"type": self.KIND, "node": self.node}

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Self:
        fields = Fields(message, f"{cls.KIND} message")
        node = fields.integer("node", 0)
        fields.check()
        return cls(node)


@dataclass(frozen=True, slots=True)
class _Reason:
    """A message whose one field is a text for a person."""

    KIND: ClassVar[str]
    reason: str

    def to_json(self) -> JsonObject:
        return {"type": self.KIND, "reason": self.reason}

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Self:
        fields = Fields(message, f"{cls.KIND} message")
        reason = fields.text("reason")
        fields.check()
        return cls(reason)


# -- between a node and the orchestrator -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class Join:
    """A node registering: where its data service listens, its peer ids, the config
    fingerprint every member must share, and ``meta`` (facts the other nodes need, passed
    through untouched)."""

    KIND: ClassVar[str] = "join"
    host: str
    port: int
    peer_ids: tuple[int, ...]
    fingerprint: JsonObject
    pid: int | None = None
    meta: JsonObject = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """How many nodes the collective has (checked by :meth:`from_json`)."""
        num_nodes = self.fingerprint.get("num_nodes")
        return num_nodes if isinstance(num_nodes, int) and is_int(num_nodes, 1) else 1

    def to_json(self) -> JsonObject:
        message: JsonObject = {"type": self.KIND, "host": self.host, "port": self.port,
                               "peer_ids": list(self.peer_ids), "fingerprint": self.fingerprint}
        if self.pid is not None:
            message["pid"] = self.pid
        message["meta"] = self.meta
        return message

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Join:
        """Everything the orchestrator relies on, checked before the node may wait: a
        malformed join is refused, never left waiting to spoil later joins, and nothing
        larger than :data:`MAX_NODE_PEERS` ids or :data:`MAX_FIELD_BYTES` is kept."""
        fields = Fields(message, "join message")
        host, port = fields.text("host", _MAX_HOST), fields.integer("port", 1, 65535)
        peer_ids = fields.ids("peer_ids", MAX_NODE_PEERS, MAX_PEER_ID)
        fingerprint = fields.json_object("fingerprint", MAX_FIELD_BYTES)
        if fingerprint.get("num_nodes") is not None and not is_int(fingerprint["num_nodes"], 1):
            fields.problem("fingerprint.num_nodes must be an int >= 1")
        pid = message.get("pid")
        if pid is not None and not is_int(pid, 0):
            fields.problem("pid must be an int >= 0")
        meta = fields.json_object("meta", MAX_FIELD_BYTES, optional=True)
        fields.check()
        return cls(host, port, peer_ids, fingerprint, pid if isinstance(pid, int) else None,
                   meta)


@dataclass(frozen=True, slots=True)
class Abandon:
    """A node that failed before it could join (its data service's port in use, two of its
    peers with one id, ...): the error it raised, by class name and message, so that the nodes
    waiting for it fail at once with the same reason. Sent instead of :class:`Join`."""

    KIND: ClassVar[str] = "abandon"
    node: int
    peer_ids: tuple[int, ...]
    fingerprint: JsonObject
    error: str
    reason: str
    pid: int = 0

    def to_json(self) -> JsonObject:
        return {"type": self.KIND, "node": self.node, "peer_ids": list(self.peer_ids),
                "fingerprint": self.fingerprint, "error": self.error,
                "reason": self.reason, "pid": self.pid}

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Abandon:
        fields = Fields(message, "abandon message")
        node, pid = fields.integer("node", 0), fields.integer("pid", 0)
        peer_ids = fields.ids("peer_ids", MAX_NODE_PEERS, MAX_PEER_ID)
        fingerprint = fields.json_object("fingerprint", MAX_FIELD_BYTES)
        error, reason = fields.text("error", _MAX_ERROR_NAME), fields.text("reason", MAX_REASON)
        fields.check()
        return cls(node, peer_ids, fingerprint, error, reason, pid)


@dataclass(frozen=True, slots=True)
class Abandoned:
    """To the nodes waiting for a collective that cannot form: a node that was to join it
    failed, or was refused. ``error``: the class name of the error it raised; ``reason``
    names it and says why (at most twice :data:`MAX_REASON` characters)."""

    KIND: ClassVar[str] = "abandoned"
    error: str
    reason: str

    def to_json(self) -> JsonObject:
        return {"type": self.KIND, "error": self.error, "reason": self.reason}

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Abandoned:
        fields = Fields(message, "abandoned message")
        error, reason = fields.text("error", _MAX_ERROR_NAME), fields.text("reason", 2 * MAX_REASON)
        fields.check()
        return cls(error, reason)


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One member of a session in the orchestrator's :class:`Table`."""

    index: int
    host: str
    port: int
    peer_ids: tuple[int, ...]
    meta: JsonObject = field(default_factory=dict)

    @classmethod
    def read(cls, fields: Fields, position: int) -> TableEntry:
        """The entry at ``position`` of a table (its ``index`` must say so)."""
        if not is_int(fields.message.get("index"), position, position):
            fields.problem(f"index must be {position}")
        host, port = fields.text("host", _MAX_HOST), fields.integer("port", 1, 65535)
        peer_ids = fields.ids("peer_ids", MAX_NODE_PEERS, MAX_PEER_ID)
        meta = fields.message.get("meta")
        if meta is not None and not isinstance(meta, dict):
            fields.problem("meta must be an object")
        return cls(position, host, port, peer_ids, meta if isinstance(meta, dict) else {})

    def to_json(self) -> JsonObject:
        return {"index": self.index, "host": self.host, "port": self.port,
                "peer_ids": list(self.peer_ids), "meta": self.meta}


@dataclass(frozen=True, slots=True)
class Table:
    """The session the orchestrator formed: its id, the receiver's index in it, every member
    (ordered by lowest peer id) and the session's secret (64 hex digits, sent to its members
    only; they authenticate each other with it when no token is set)."""

    KIND: ClassVar[str] = "table"
    session: int
    index: int
    nodes: tuple[TableEntry, ...]
    secret: str | None

    def to_json(self) -> JsonObject:
        return {"type": self.KIND, "session": self.session, "index": self.index,
                "nodes": [n.to_json() for n in self.nodes], "secret": self.secret}

    @classmethod
    def frames(cls, session: int, nodes: Sequence[TableEntry], secret: str | None
               ) -> list[bytes]:
        """Every member's table frame, by index: the bytes of ``encode(Table(session, i,
        nodes, secret), session)``, the nodes encoded once (the orchestrator's work for a
        session of ``N`` nodes grows with ``N``, not ``N**2``: 1,024 nodes took 2.8 s)."""
        listed = json.dumps([n.to_json() for n in nodes], separators=(",", ":"))
        head = f'{{"type":{json.dumps(cls.KIND)},"session":{session},"index":'
        tail = f',"nodes":{listed},"secret":{json.dumps(secret)}}}'
        return [control_frame(f"{head}{index}{tail}".encode(), session)
                for index in range(len(nodes))]

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Table:
        fields = Fields(message, "node table")
        session = fields.integer("session", 0, MAX_SESSION)
        listed = message.get("nodes")
        nodes: list[TableEntry] = []
        if not isinstance(listed, list) or not listed:
            fields.problem("nodes must be a non-empty list")
        for position, entry in enumerate(listed if isinstance(listed, list) else []):
            if not isinstance(entry, dict):
                fields.problem(f"nodes[{position}] must be an object")
                break
            reader = Fields(entry, "node table", f"nodes[{position}].")
            nodes.append(TableEntry.read(reader, position))
            if reader.problems:
                fields.problems.extend(reader.problems)
                break
        index = fields.integer("index", 0, max(len(nodes) - 1, 0))
        secret = message.get("secret")
        if secret is not None and not (isinstance(secret, str) and len(secret) == _SECRET_HEX
                                       and all(c in "0123456789abcdefABCDEF" for c in secret)):
            fields.problem("the session secret is not 64 hex digits")
        fields.check()
        return cls(session, index, tuple(nodes), secret if isinstance(secret, str) else None)


@dataclass(frozen=True, slots=True)
class Refused(_Reason):
    """The orchestrator refuses a node, saying why."""

    KIND: ClassVar[str] = "refused"


@dataclass(frozen=True, slots=True)
class Notice(_Reason):
    """While a node waits: other nodes wait whose config differs (informational)."""

    KIND: ClassVar[str] = "notice"


@dataclass(frozen=True, slots=True)
class NodeLost(AboutNode):
    """A member's connection to the orchestrator dropped before it finished."""

    KIND: ClassVar[str] = "node_lost"


@dataclass(frozen=True, slots=True)
class Finish(_Bare):
    """A node is done with the session (its ``finish()``)."""

    KIND: ClassVar[str] = "finish"


@dataclass(frozen=True, slots=True)
class Finished(_Bare):
    """Every member of the session has finished."""

    KIND: ClassVar[str] = "finished"


@dataclass(frozen=True, slots=True)
class Leave(_Bare):
    """A node leaves a failed collective on purpose: do not report it lost."""

    KIND: ClassVar[str] = "leave"


FromNode: TypeAlias = "Join | Abandon | Finish | Leave"
FromOrchestrator: TypeAlias = "Table | Refused | Abandoned | Notice | Finished | NodeLost"
_FROM_NODE: dict[str, Callable[[Mapping[str, object]], FromNode]] = {
    m.KIND: m.from_json for m in (Join, Abandon, Finish, Leave)}
_FROM_ORCHESTRATOR: dict[str, Callable[[Mapping[str, object]], FromOrchestrator]] = {
    m.KIND: m.from_json for m in (Table, Refused, Abandoned, Notice, Finished, NodeLost)}


def decode_by_type(frame: Frame, parsers: Mapping[str, Callable[[Mapping[str, object]], M]]
                   ) -> M | None:
    """The message of a CONTROL frame, by the parser of its ``"type"``; ``None`` for a DATA
    frame or a type without a parser."""
    control = frame.control
    parse = None if control is None else parsers.get(control["type"])
    return None if parse is None else parse(frame.control or {})


def decode_from_node(frame: Frame) -> FromNode | None:
    """The message a node sent the orchestrator; ``None`` for anything else."""
    return decode_by_type(frame, _FROM_NODE)


def decode_from_orchestrator(frame: Frame) -> FromOrchestrator | None:
    """The message the orchestrator sent a node; ``None`` for anything else."""
    return decode_by_type(frame, _FROM_ORCHESTRATOR)
