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
u64 little-endian; :class:`~burncoll.transport.assembler.MessageAssembler` cuts such a stream
back into messages.
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

__all__ = ["CONTROL_LIMIT", "DEFAULT_MAX_MESSAGE_BYTES", "DataHeader", "FrameType",
           "LENGTH_PREFIX_BYTES", "MAX_NDIM", "SRC_AT", "SRC_END", "WIRE_VERSION",
           "announced_lengths", "control_frame", "decode", "decode_control", "decode_data_head",
           "encode_control", "encode_data_header", "restamped"]

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
    #: The payload is memory the transport lent (:attr:`Placed.lent`): copy it out, or
    #: combine it into its place, before the connection's next ``recv`` (:meth:`owned`).
    borrowed: bool = False

    def owned(self) -> Frame:
        """This frame with a payload of its own (a copy, if it was borrowed)."""
        if not self.borrowed:
            return self
        return Frame(self.frame_type, self.header, memoryview(bytearray(self.payload)),
                     self.control, self.placed)


@dataclass(frozen=True, slots=True)
class Placed:
    """A DATA message as a transport delivers it when the payload was received straight into its
    destination (see ``StreamProtocol.placer``): the header bytes, and the destination. ``lent``:
    the whole message (``head`` empty, ``payload`` all of it) was not moved at all: it is the
    transport's own memory (the shared-memory ring), valid until the connection's next ``recv``; its
    frame is :attr:`Frame.borrowed`."""

    head: bytes
    payload: memoryview
    lent: bool = False

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
    fixed = _FIXED.pack(MAGIC, WIRE_VERSION, FrameType.DATA, h.session, h.seq, h.op_kind,
                        0 if h.reduce_op is None else h.reduce_op,
                        0 if h.dtype is None else WIRE_CODES[h.dtype], len(h.shape), h.root, h.src,
                        h.round, h.channel, h.chunk, h.offset, h.chunk_bytes, payload_len)
    return fixed + struct.pack(f"<{len(h.shape)}Q", *h.shape)


_SEQ_AT = 12  # where a header's seq (u64) sits (see above)
#: Where a header's sender (an i32) sits: ``header[SRC_AT:SRC_END]``.
SRC_AT, SRC_END = 32, 36


def restamped(header: bytes, seq: int, src: int) -> bytes:
    """An encoded DATA header (:func:`encode_data_header`) with another ``seq`` and
    ``src``: every other byte stays."""
    out = bytearray(header)
    struct.pack_into("<Q", out, _SEQ_AT, seq)
    struct.pack_into("<i", out, SRC_AT, src)
    return bytes(out)


def encode_control(message: dict[str, Any], session: int = 0) -> bytes:
    """A whole CONTROL frame carrying ``message`` as JSON."""
    return control_frame(json.dumps(message, separators=(",", ":")).encode(), session)


def control_frame(body: bytes, session: int = 0) -> bytes:
    """A whole CONTROL frame carrying ``body``, a JSON object already encoded."""
    if len(body) > CONTROL_LIMIT:
        raise ProtocolError(f"control message of {len(body)} bytes exceeds {CONTROL_LIMIT}")
    fixed = _FIXED.pack(MAGIC, WIRE_VERSION, FrameType.CONTROL, session, 0, 0, 0, 0, 0, -1, -1, 0,
                        0, 0, 0, len(body), len(body))
    return fixed + body


def decode(message: bytes | bytearray | memoryview | Placed) -> Frame:
    """Decode one whole message. Raises :class:`ProtocolError` saying what is wrong."""
    if isinstance(message, Placed):
        if message.lent:
            return _decode(message.payload, None, lent=True)
        return _decode(memoryview(message.head), message.payload)
    return _decode(memoryview(message).cast("B"), None)


def _decode(view: memoryview, placed: memoryview | None, lent: bool = False) -> Frame:
    """``view``: the whole message, or only its header when the payload is ``placed``."""
    fields = _fixed_fields(view)
    frame_type, ndim, payload_len = fields[2], fields[8], fields[16]
    header_len = FIXED_HEADER_BYTES + 8 * ndim
    size = len(view) + (len(placed) if placed is not None else 0)
    if size != header_len + payload_len or (placed is not None and len(view) != header_len):
        raise ProtocolError(
            f"frame is {size} bytes but its header announces {header_len + payload_len}"
        )
    payload = view[header_len:] if placed is None else placed
    if frame_type == FrameType.CONTROL:
        return Frame(FrameType.CONTROL, None, payload, decode_control(payload), False, lent)
    if frame_type != FrameType.DATA:
        raise ProtocolError(f"unknown frame type {frame_type}")
    return Frame(FrameType.DATA, _data_header(view, fields), payload, None,
                 placed is not None, lent)


def announced_lengths(first: memoryview) -> tuple[int, int]:
    """The header length and the whole length that a frame's first
    :data:`FIXED_HEADER_BYTES` bytes announce, unchecked (shape entries beyond
    :data:`MAX_NDIM` are not counted in the header's length)."""
    fields = _FIXED.unpack_from(first)
    ndim, payload_len = fields[8], fields[16]
    header = FIXED_HEADER_BYTES + 8 * ndim
    return (header if ndim <= MAX_NDIM else FIXED_HEADER_BYTES), header + payload_len


def decode_data_head(head: memoryview) -> tuple[DataHeader, int]:
    """The DATA header at the start of ``head`` (which holds at least the whole header; the
    payload need not be there) and the payload length it announces. Raises
    :class:`ProtocolError` saying what is wrong."""
    fields = _fixed_fields(head)
    if fields[2] != FrameType.DATA:
        raise ProtocolError(f"expected a DATA frame, got frame type {fields[2]}")
    if len(head) < FIXED_HEADER_BYTES + 8 * fields[8]:
        raise ProtocolError("a DATA frame's header was cut short")
    return _data_header(head, fields), int(fields[16])


def _fixed_fields(view: memoryview) -> tuple[Any, ...]:
    """The fixed header's fields, once magic, version and ``ndim`` are checked."""
    if len(view) < FIXED_HEADER_BYTES:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than the header")
    fields = _FIXED.unpack_from(view)
    magic, version, ndim = fields[0], fields[1], fields[8]
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a burncoll frame")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version} is not supported (this is {WIRE_VERSION})")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
    return fields


def _data_header(view: memoryview, fields: tuple[Any, ...]) -> DataHeader:
    """The DATA header of ``fields`` (:func:`_fixed_fields`) with its shape from ``view``."""
    (_magic, _version, _type, session, seq, op_kind, reduce_op, dtype, ndim, root, src,
     round_, channel, chunk, offset, chunk_bytes, payload_len) = fields
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
    return DataHeader(session=session, seq=seq, op_kind=OpKind(op_kind),
                      reduce_op=None if reduce_op == 0 else ReduceOp(reduce_op),
                      dtype=WIRE_NAMES.get(dtype), shape=tuple(shape), root=root, src=src,
                      round=round_, channel=channel, chunk=chunk, offset=offset,
                      chunk_bytes=chunk_bytes)


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
