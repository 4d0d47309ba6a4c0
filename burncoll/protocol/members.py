"""The messages between two members of a session, as frozen dataclasses.

A dialer opens with :class:`Hello` (:mod:`burncoll.node.dialing`); a member leaving cleanly
says :class:`Bye`, a failing one :class:`Abort`; a member whose operation timed out asks the
others :class:`StatusQuery` and they answer :class:`Status`
(:mod:`burncoll.node.data_service`, :mod:`burncoll.node.reading`); the receiver of a
point-to-point message acknowledges it with :class:`P2PAck`. The orchestrator never sees
them, so they live apart from its conversation (:mod:`burncoll.protocol.control`, whose frame,
shapes and checks they share): same JSON objects, same bytes, the same strict decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from burncoll.levels import MAX_TAG
from burncoll.protocol.control import MAX_PEER_ID, MAX_SESSION, AboutNode, decode_by_type
from burncoll.protocol.fields import Fields, JsonObject, MalformedMessage, count, int_tuple, is_int
from burncoll.protocol.wire import Frame

__all__ = ["MAX_REFUSAL", "Abort", "Bye", "Hello", "MemberMessage", "P2PAck", "Status",
           "StatusQuery", "decode_member"]

#: Longest reason a receiver gives for refusing a point-to-point message (characters).
MAX_REFUSAL = 1000
#: Largest rank in a point-to-point message (a DATA header's u32 ``chunk`` carries the src).
_MAX_RANK = 2**32 - 1
#: Longest table digest in a hello (hex digits).
_DIGEST_HEX = 64
#: Largest message number (a DATA header's u64 ``seq``).
_MAX_SEQ = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Hello:
    """A dialer's first frame: which member it is, of which session."""

    KIND: ClassVar[str] = "hello"
    node: int
    session: int
    #: The connection is to be the two nodes' caller socket (:mod:`burncoll.node.lanes`).
    lane: bool = False
    #: The digest of the node table the dialer holds
    #: (:func:`burncoll.node.membership.table_digest`).
    table: str = ""

    def to_json(self) -> JsonObject:
        message: JsonObject = {"type": self.KIND, "node": self.node, "session": self.session}
        if self.lane:
            message["lane"] = True
        if self.table:
            message["table"] = self.table
        return message

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Hello:
        node, session = message.get("node"), message.get("session")
        if not is_int(node, 0):
            raise MalformedMessage(f"hello from an unknown node {node!r}")
        if session is None:
            raise MalformedMessage(f"hello from node {node} without its session")
        if not is_int(session, 0, MAX_SESSION):
            raise MalformedMessage(f"hello from node {node} of another session ({session!r})")
        lane = message.get("lane", False)
        if not isinstance(lane, bool):
            raise MalformedMessage(f"hello from node {node} with a lane flag {lane!r}")
        table = message.get("table", "")
        if not (isinstance(table, str) and len(table) <= _DIGEST_HEX
                and all(c in "0123456789abcdef" for c in table)):
            raise MalformedMessage(f"hello from node {node} with a table digest that is not "
                                   f"up to {_DIGEST_HEX} lowercase hex digits")
        assert isinstance(node, int) and isinstance(session, int)
        return cls(node, session, lane, table)


@dataclass(frozen=True, slots=True)
class Bye(AboutNode):
    """A member leaving cleanly: its connections end, and that is no failure."""

    KIND: ClassVar[str] = "bye"


@dataclass(frozen=True, slots=True)
class StatusQuery(AboutNode):
    """``status?``: what are your peers doing? (asked when an operation times out)."""

    KIND: ClassVar[str] = "status?"


@dataclass(frozen=True, slots=True)
class Abort:
    """A member failed the session: the error's class name and message, for every node to
    raise (see :func:`burncoll.node.membership.error_from_abort`), and the operation number
    below which it had finished every operation (``None``: unknown), for which the failure
    waits (:mod:`burncoll.node.remote_failure`)."""

    KIND: ClassVar[str] = "abort"
    node: int
    error: str
    message: str
    done_before: int | None = None

    def to_json(self) -> JsonObject:
        message: JsonObject = {"type": self.KIND, "node": self.node, "error": self.error,
                               "message": self.message}
        if self.done_before is not None:
            message["done_before"] = self.done_before
        return message

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Abort:
        fields = Fields(message, "abort message")
        node, error, text = fields.integer("node", 0), fields.text("error"), fields.text("message")
        done = fields.integer("done_before", 0) if "done_before" in message else None
        fields.check()
        return cls(node, error, text, done)


@dataclass(frozen=True, slots=True)
class Status:
    """The answer to a :class:`StatusQuery`: which of the node's peers arrived at which
    operation, and each peer's next operation. ``None``: the node has no local level yet
    (the field is then left out of the message)."""

    KIND: ClassVar[str] = "status"
    node: int
    #: Operation sequence number -> the peer ids whose call of it has arrived.
    arrived: Mapping[int, tuple[int, ...]] | None = None
    #: Peer id -> the sequence number of its next operation.
    next_seq: Mapping[int, int] | None = None

    def to_json(self) -> JsonObject:
        message: JsonObject = {"type": self.KIND, "node": self.node}
        if self.arrived is not None:  # json spells the int keys as strings
            message["arrived"] = {str(k): list(v) for k, v in self.arrived.items()}
        if self.next_seq is not None:
            message["next_seq"] = {str(k): v for k, v in self.next_seq.items()}
        return message

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> Status:
        fields = Fields(message, "status message")
        node = fields.integer("node", 0)
        arrived = fields.int_map("arrived", lambda v: int_tuple(v, MAX_PEER_ID),
                                 "lists of peer ids")
        next_seq = fields.int_map("next_seq", count, "ints >= 0")
        fields.check()
        return cls(node, arrived, next_seq)

    @classmethod
    def of(cls, node: int, report: Mapping[str, object]) -> Status:
        """This node's answer, from its local level's report (``arrived``, ``next_seq``),
        checked as another node checks it."""
        return cls.from_json({"type": cls.KIND, "node": node, **report})


@dataclass(frozen=True, slots=True)
class P2PAck:
    """The receiving node took message ``seq`` of ``(src, dst, tag)`` (ranks; a recv matched
    it), or refused it: ``refused`` says why (a recv whose ``out=`` has another dtype or
    shape). Sent back to the sending node (:mod:`burncoll.node.p2p_link`), whose send then
    returns, or raises :class:`~burncoll.MismatchError` with the reason."""

    KIND: ClassVar[str] = "p2p-ack"
    node: int
    src: int
    dst: int
    tag: int
    seq: int
    refused: str | None = None

    def to_json(self) -> JsonObject:
        message: JsonObject = {"type": self.KIND, "node": self.node, "src": self.src,
                               "dst": self.dst, "tag": self.tag, "seq": self.seq}
        if self.refused is not None:
            message["refused"] = self.refused
        return message

    @classmethod
    def from_json(cls, message: Mapping[str, object]) -> P2PAck:
        fields = Fields(message, "p2p-ack message")
        node = fields.integer("node", 0)
        src, dst = fields.integer("src", 0, _MAX_RANK), fields.integer("dst", 0, _MAX_RANK)
        tag, seq = fields.integer("tag", 0, MAX_TAG), fields.integer("seq", 0, _MAX_SEQ)
        refused = fields.text("refused", MAX_REFUSAL) if "refused" in message else None
        fields.check()
        return cls(node, src, dst, tag, seq, refused)


MemberMessage: TypeAlias = "Hello | Bye | Abort | StatusQuery | Status | P2PAck"
_MEMBER: dict[str, Callable[[Mapping[str, object]], MemberMessage]] = {
    m.KIND: m.from_json for m in (Hello, Bye, Abort, StatusQuery, Status, P2PAck)}


def decode_member(frame: Frame) -> MemberMessage | None:
    """The message of a member's CONTROL frame; ``None`` for a DATA frame or another type."""
    return decode_by_type(frame, _MEMBER)
