"""The frame codec: a fixed little-endian binary header, then raw bytes. Nothing is pickled.

Layout (all little-endian)::

    offset size field
         0    2 magic          b"BC"
         2    1 version        WIRE_VERSION
         3    1 frame_type     FrameType (DATA, CONTROL)
         4    8 session        u64, the collective's session id (from the orchestrator)
        12    8 seq            u64, the operation's sequence number
        20    1 op_kind        OpKind code (0 for CONTROL)
        21    1 reduce_op      ReduceOp code (0 when the op does not reduce)
        22    1 dtype          dtype code (0 for none)
        23    1 ndim           number of shape entries that follow the fixed header
        24    8 root           i64, the root's peer id (-1 when the op has none)
        32    4 src            i32, the sending node's index
        36    2 round          u16, the schedule round this frame belongs to
        38    2 channel        u16, which concurrent sub-collective (local shard) it belongs to
        40    4 chunk          u32, the schedule chunk
        44    8 offset         u64, byte offset of this part within the chunk
        52    8 chunk_bytes    u64, total bytes of the chunk
        60    8 payload_len    u64, bytes that follow the shape
        68 8*nd shape          u64 each, the operation's array shape (its fingerprint)

The header carries the operation's fingerprint (op kind, reduce op, dtype, shape, root): a
receiver compares it with its own call and reports a mismatch instead of mixing data. The
sequence number is part of the frame's key, so a frame of another operation waits or is refused.
CONTROL frames carry a small JSON object (orchestrator messages, aborts, status queries).

Transports without message boundaries (a QUIC stream) send each message behind its length, a
u64 little-endian; :class:`MessageAssembler` cuts such a stream back into messages.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from burncoll.dtypes import WIRE_CODES, WIRE_NAMES
from burncoll.errors import ProtocolError
from burncoll.ops import OpKind, ReduceOp

__all__ = [
    "CONTROL_LIMIT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DataHeader",
    "FrameType",
    "LENGTH_PREFIX_BYTES",
    "MAX_NDIM",
    "MessageAssembler",
    "MessageTooBig",
    "WIRE_VERSION",
    "decode",
    "decode_control",
    "encode_control",
    "encode_data_header",
]

MAGIC = b"BC"
WIRE_VERSION = 1
MAX_NDIM = 32
#: Largest CONTROL payload accepted (JSON).
CONTROL_LIMIT = 1 << 20
#: Largest whole message (header + payload) a transport accepts unless configured otherwise:
#: a 64 MiB payload and room for its header.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20 + 4096
#: Bytes of the length before each message on a byte stream.
LENGTH_PREFIX_BYTES = 8

_FIXED = struct.Struct("<2sBBQQBBBBqiHHIQQQ")
FIXED_HEADER_BYTES = _FIXED.size  # 68

_OP_KINDS = {k.value for k in OpKind}
_REDUCE_OPS = {r.value for r in ReduceOp}


class FrameType(enum.IntEnum):
    DATA = 1
    CONTROL = 2


@dataclass(frozen=True, slots=True)
class DataHeader:
    """The decoded header of a DATA frame (see the module docstring for each field)."""

    session: int
    seq: int
    op_kind: OpKind
    reduce_op: ReduceOp | None
    dtype: str | None
    shape: tuple[int, ...]
    root: int
    src: int
    round: int
    channel: int
    chunk: int
    offset: int
    chunk_bytes: int

    def fingerprint(self) -> tuple[object, ...]:
        """What must agree between peers for the same operation."""
        return (self.op_kind, self.reduce_op, self.dtype, self.shape, self.root)


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: a DATA header and its payload, or a CONTROL message."""

    frame_type: FrameType
    header: DataHeader | None
    payload: memoryview
    control: dict[str, Any] | None
    #: The payload was received straight into the memory its receiver registered for it.
    placed: bool = False


@dataclass(frozen=True, slots=True)
class Placed:
    """A DATA message as a transport delivers it when the payload was received straight into
    its destination (see ``StreamProtocol.placer``): the header bytes, and the destination."""

    head: bytes
    payload: memoryview

    def __len__(self) -> int:
        return len(self.head) + len(self.payload)


@dataclass(frozen=True, slots=True)
class PartPeek:
    """What a DATA message's first bytes say about where its payload belongs."""

    header_len: int
    session: int
    #: ``(seq, channel, round, src, chunk)``, as the mailbox keys frames.
    key: tuple[int, int, int, int, int]
    offset: int
    payload_len: int


def peek_part(first: memoryview) -> PartPeek | None:
    """The routing fields of the collective DATA message starting with ``first``; ``None``
    when ``first`` does not hold its whole header, is not a DATA frame of this wire version
    (:func:`decode` then says what is wrong, once the message is whole), or is a
    point-to-point message (its own inbox copies it)."""
    if len(first) < FIXED_HEADER_BYTES:
        return None
    (magic, version, frame_type, session, seq, op, _reduce, _dtype, ndim, _root, src,
     round_, channel, chunk, offset, _chunk_bytes, payload_len) = _FIXED.unpack_from(first)
    if magic != MAGIC or version != WIRE_VERSION or frame_type != FrameType.DATA or (
            ndim > MAX_NDIM) or len(first) < FIXED_HEADER_BYTES + 8 * ndim:
        return None
    if op == OpKind.P2P:  # a point-to-point message never lands in a collective's memory
        return None
    return PartPeek(FIXED_HEADER_BYTES + 8 * int(ndim), int(session),
                    (int(seq), int(channel), int(round_), int(src), int(chunk)), int(offset),
                    int(payload_len))


def encode_data_header(h: DataHeader, payload_len: int) -> bytes:
    """The bytes of a DATA frame's header; the payload is sent right after it."""
    if len(h.shape) > MAX_NDIM:
        raise ProtocolError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
    fixed = _FIXED.pack(
        MAGIC,
        WIRE_VERSION,
        FrameType.DATA,
        h.session,
        h.seq,
        h.op_kind,
        0 if h.reduce_op is None else h.reduce_op,
        0 if h.dtype is None else WIRE_CODES[h.dtype],
        len(h.shape),
        h.root,
        h.src,
        h.round,
        h.channel,
        h.chunk,
        h.offset,
        h.chunk_bytes,
        payload_len,
    )
    return fixed + struct.pack(f"<{len(h.shape)}Q", *h.shape)


def encode_control(message: dict[str, Any], session: int = 0) -> bytes:
    """A whole CONTROL frame carrying ``message`` as JSON."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > CONTROL_LIMIT:
        raise ProtocolError(f"control message of {len(body)} bytes exceeds {CONTROL_LIMIT}")
    fixed = _FIXED.pack(
        MAGIC, WIRE_VERSION, FrameType.CONTROL, session, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0,
        len(body), len(body),
    )
    return fixed + body


def decode(message: bytes | bytearray | memoryview | Placed) -> Frame:
    """Decode one whole message. Raises :class:`ProtocolError` saying what is wrong."""
    if isinstance(message, Placed):
        return _decode(memoryview(message.head), message.payload)
    return _decode(memoryview(message).cast("B"), None)


def _decode(view: memoryview, placed: memoryview | None) -> Frame:
    """``view``: the whole message, or only its header when the payload is ``placed``."""
    if len(view) < FIXED_HEADER_BYTES:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than the header")
    (magic, version, frame_type, session, seq, op_kind, reduce_op, dtype, ndim, root, src,
     round_, channel, chunk, offset, chunk_bytes, payload_len) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a burncoll frame")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version} is not supported (this is {WIRE_VERSION})")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
    header_len = FIXED_HEADER_BYTES + 8 * ndim
    size = len(view) + (len(placed) if placed is not None else 0)
    if size != header_len + payload_len or (placed is not None and len(view) != header_len):
        raise ProtocolError(
            f"frame is {size} bytes but its header announces {header_len + payload_len}"
        )
    payload = view[header_len:] if placed is None else placed
    if frame_type == FrameType.CONTROL:
        return Frame(FrameType.CONTROL, None, payload, decode_control(payload))
    if frame_type != FrameType.DATA:
        raise ProtocolError(f"unknown frame type {frame_type}")
    if op_kind not in _OP_KINDS:
        raise ProtocolError(f"unknown operation code {op_kind}")
    if reduce_op != 0 and reduce_op not in _REDUCE_OPS:
        raise ProtocolError(f"unknown reduce op code {reduce_op}")
    if dtype != 0 and dtype not in WIRE_NAMES:
        raise ProtocolError(f"unknown dtype code {dtype}")
    if offset + payload_len > chunk_bytes:
        raise ProtocolError(
            f"part at offset {offset} of {payload_len} bytes overruns its chunk of {chunk_bytes}"
        )
    shape = struct.unpack_from(f"<{ndim}Q", view, FIXED_HEADER_BYTES)
    header = DataHeader(
        session=session,
        seq=seq,
        op_kind=OpKind(op_kind),
        reduce_op=None if reduce_op == 0 else ReduceOp(reduce_op),
        dtype=WIRE_NAMES.get(dtype),
        shape=tuple(shape),
        root=root,
        src=src,
        round=round_,
        channel=channel,
        chunk=chunk,
        offset=offset,
        chunk_bytes=chunk_bytes,
    )
    return Frame(FrameType.DATA, header, payload, None, placed is not None)


def decode_control(payload: memoryview) -> dict[str, Any]:
    """The JSON object of a CONTROL frame. Raises :class:`ProtocolError` if it is not one."""
    if len(payload) > CONTROL_LIMIT:
        raise ProtocolError(f"control message of {len(payload)} bytes exceeds {CONTROL_LIMIT}")
    try:
        message = json.loads(bytes(payload))
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integers;
        # RecursionError, deeply nested arrays.
        raise ProtocolError(f"control message is not valid JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("control message must be a JSON object with a string 'type'")
    return message


class MessageTooBig(ProtocolError):
    """A message announced on a stream is longer than the receiver accepts."""


class MessageAssembler:
    """Sans-I/O: cuts a byte stream of length-prefixed messages back into whole messages.

    ``feed`` accepts stream data in chunks of any size. A message's bytes are copied once,
    into a buffer allocated when its length is read and checked. Raises
    :class:`~burncoll.ProtocolError` (:class:`MessageTooBig` for a size) when the stream does
    not start with ``preamble`` or announces a message over ``max_message_bytes``; the
    assembler is then unusable.

    **Before authentication.** With ``preauth_bytes`` set, the other side is a stranger until
    :meth:`authenticated` is called, and the assembler trusts nothing it says:

    * it accepts at most ``preauth_bytes`` in total (preamble, lengths and messages together);
      a ``feed`` that goes past them raises :class:`MessageTooBig`;
    * ``feed`` only keeps the bytes (it returns no message): messages are cut from them one at
      a time, when the reader asks for the next one (:meth:`next_held`). So whatever the peer
      pipelines behind the messages read before authentication (a side that has just proved
      itself may send its first large message at once) waits, bounded, for
      :meth:`authenticated`, instead of being judged by the pre-authentication budget;
    * a message whose length does not fit in what is left of the budget is refused as soon
      as its length is cut (:class:`MessageTooBig` naming the limit), before anything is
      allocated for it: no buffer larger than ``preauth_bytes`` ever exists on a stranger's
      word.
    """

    def __init__(
        self, max_message_bytes: int, preamble: bytes = b"", *, preauth_bytes: int | None = None
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self._preamble = preamble
        self._head = bytearray()  # preamble or length bytes collected so far
        self._message: bytearray | None = None
        self._filled = 0
        #: The pre-authentication budget; ``None`` once authenticated (or never limited).
        self._preauth_bytes = preauth_bytes
        self._held = bytearray()  # bytes fed before authentication, not cut yet
        self._fed = 0  # bytes fed before authentication
        self._cut_bytes = 0  # bytes cut into preamble, lengths and messages

    @property
    def mid_message(self) -> bool:
        """Whether bytes have been fed that do not complete a message (or that are held, not
        yet cut, before authentication)."""
        return bool(self._head) or self._message is not None or bool(self._held)

    @property
    def is_authenticated(self) -> bool:
        """Whether messages are cut as they arrive (no pre-authentication budget applies)."""
        return self._preauth_bytes is None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        """Take the next stream bytes; return the messages they complete, in order (always
        none before authentication: see the class docstring)."""
        view = memoryview(data).cast("B")
        limit = self._preauth_bytes
        if limit is None:
            return self._cut(view, first_only=False)[0]
        if self._fed + len(view) > limit:
            raise MessageTooBig(
                f"{self._fed + len(view)} bytes arrived before authentication: over the "
                f"pre-authentication limit ({limit} bytes)"
            )
        self._fed += len(view)
        self._held += view
        return []

    def next_held(self) -> bytearray | None:
        """Before authentication: cut the next message from the bytes held, or ``None`` when
        they do not complete one yet. After it: ``None`` (``feed`` returns every message)."""
        if self._preauth_bytes is None or not self._held:
            return None
        messages, used = self._cut(memoryview(self._held), first_only=True)
        del self._held[:used]
        return messages[0] if messages else None

    def authenticated(self) -> list[bytearray]:
        """The other side authenticated: lift the budget and return the messages completed by
        the bytes held so far (they are then checked against ``max_message_bytes`` only)."""
        if self._preauth_bytes is None:
            return []
        self._preauth_bytes = None
        held, self._held = self._held, bytearray()
        return self._cut(memoryview(held), first_only=False)[0]

    def _cut(self, view: memoryview, *, first_only: bool) -> tuple[list[bytearray], int]:
        """Cut ``view`` into messages; stop after the first completed one when
        ``first_only``. Returns the messages and how many bytes of ``view`` were used."""
        done: list[bytearray] = []
        total = len(view)
        while view and not (first_only and done):
            if self._preamble:
                view = self._take_preamble(view)
            elif self._message is None:
                view = self._take_length(view)
            else:
                take = min(len(view), len(self._message) - self._filled)
                self._message[self._filled : self._filled + take] = view[:take]
                self._filled += take
                self._cut_bytes += take
                view = view[take:]
            if self._message is not None and self._filled == len(self._message):
                done.append(self._message)
                self._message = None
        return done, total - len(view)

    def _take_preamble(self, view: memoryview) -> memoryview:
        take = min(len(view), len(self._preamble) - len(self._head))
        self._head += view[:take]
        self._cut_bytes += take
        if len(self._head) == len(self._preamble):
            if self._head != self._preamble:
                opened = bytes(self._head)
                raise ProtocolError(f"stream opened with {opened!r}: not a burncoll peer")
            self._preamble = b""
            self._head.clear()
        return view[take:]

    def _take_length(self, view: memoryview) -> memoryview:
        take = min(len(view), LENGTH_PREFIX_BYTES - len(self._head))
        self._head += view[:take]
        self._cut_bytes += take
        if len(self._head) == LENGTH_PREFIX_BYTES:
            size = int.from_bytes(self._head, "little")
            self._head.clear()
            self._check_size(size)
            self._message, self._filled = bytearray(size), 0
        return view[take:]

    def _check_size(self, size: int) -> None:
        """Refuse a message of ``size`` bytes, its length just cut, before allocating it."""
        limit = self._preauth_bytes
        if limit is not None and size > limit - self._cut_bytes:
            raise MessageTooBig(
                f"message of {size} bytes exceeds the pre-authentication limit ({limit} "
                f"bytes, {max(limit - self._cut_bytes, 0)} of them left): a peer may send no "
                "more until it has authenticated"
            )
        if size > self.max_message_bytes:
            raise MessageTooBig(
                f"message of {size} bytes exceeds the limit of {self.max_message_bytes} bytes"
            )
