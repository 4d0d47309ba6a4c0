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

The header is the operation's fingerprint (op kind, reduce op, dtype, shape, root, sequence):
a receiver compares it with its own call and reports a mismatch instead of mixing data.
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

from burncoll.errors import ProtocolError
from burncoll.ops import OpKind, ReduceOp

__all__ = [
    "CONTROL_LIMIT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DTYPE_CODES",
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

#: dtype name -> wire code. Code 0 means "no array".
DTYPE_CODES: dict[str, int] = {
    "float16": 1,
    "bfloat16": 2,
    "float32": 3,
    "float64": 4,
    "int8": 5,
    "int16": 6,
    "int32": 7,
    "int64": 8,
    "uint8": 9,
    "uint16": 10,
    "uint32": 11,
    "uint64": 12,
    "complex64": 13,
    "complex128": 14,
    "bool": 15,
}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
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
    """The routing fields of the DATA message starting with ``first``; ``None`` when
    ``first`` does not hold its whole header, or is not a DATA frame of this wire version
    (:func:`decode` then says what is wrong, once the message is whole)."""
    if len(first) < FIXED_HEADER_BYTES:
        return None
    (magic, version, frame_type, session, seq, _op, _reduce, _dtype, ndim, _root, src,
     round_, channel, chunk, offset, _chunk_bytes, payload_len) = _FIXED.unpack_from(first)
    if magic != MAGIC or version != WIRE_VERSION or frame_type != FrameType.DATA or (
            ndim > MAX_NDIM) or len(first) < FIXED_HEADER_BYTES + 8 * ndim:
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
        0 if h.dtype is None else DTYPE_CODES[h.dtype],
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
    if dtype != 0 and dtype not in _DTYPE_NAMES:
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
        dtype=_DTYPE_NAMES.get(dtype),
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

    ``feed`` accepts stream data in chunks of any size and returns the messages completed by
    it, in order. A message's bytes are copied once, into a buffer allocated when its length
    is read. Raises :class:`~burncoll.ProtocolError` when the stream does not start with
    ``preamble`` or announces a message over ``max_message_bytes``; the assembler is then
    unusable.
    """

    def __init__(self, max_message_bytes: int, preamble: bytes = b"") -> None:
        self.max_message_bytes = max_message_bytes
        self._preamble = preamble
        self._head = bytearray()  # preamble or length bytes collected so far
        self._message: bytearray | None = None
        self._filled = 0

    @property
    def mid_message(self) -> bool:
        """Whether part of a message (or of its length) has been fed but not completed."""
        return bool(self._head) or self._message is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        view = memoryview(data).cast("B")
        done: list[bytearray] = []
        while view:
            if self._preamble:
                take = len(self._preamble) - len(self._head)
                self._head += view[:take]
                view = view[take:]
                if len(self._head) == len(self._preamble):
                    if self._head != self._preamble:
                        opened = bytes(self._head)
                        raise ProtocolError(f"stream opened with {opened!r}: not a burncoll peer")
                    self._preamble = b""
                    self._head.clear()
            elif self._message is None:
                take = LENGTH_PREFIX_BYTES - len(self._head)
                self._head += view[:take]
                view = view[take:]
                if len(self._head) == LENGTH_PREFIX_BYTES:
                    size = int.from_bytes(self._head, "little")
                    self._head.clear()
                    if size > self.max_message_bytes:
                        raise MessageTooBig(
                            f"message of {size} bytes exceeds the limit of "
                            f"{self.max_message_bytes} bytes"
                        )
                    self._message, self._filled = bytearray(size), 0
            else:
                take = min(len(view), len(self._message) - self._filled)
                self._message[self._filled : self._filled + take] = view[:take]
                self._filled += take
                view = view[take:]
            if self._message is not None and self._filled == len(self._message):
                done.append(self._message)
                self._message = None
        return done
