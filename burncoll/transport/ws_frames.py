"""RFC 6455 frames without I/O: bytes in, checked headers and joined messages out; headers,
frames and masks out.

Testable on plain bytes (``tests/transport/test_ws_frames.py``);
:class:`~burncoll.transport.websocket.WebSocketProtocol` drives it. A breach earns its close
code (section 7.4.1): 1002 for reserved bits (no extension is negotiated), an unknown opcode, a
frame masked in the wrong direction (5.1), a fragmented or oversized control frame (5.5,
:data:`MAX_CONTROL_PAYLOAD`), a stray continuation or a new message inside one (5.4); 1003 for
a text message (burncoll speaks binary); 1009 for a message announcing more than the limit.
Lengths are accepted in any encoding, minimal or not: the limit on the announced size is what
protects the receiver.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from burncoll.errors import ProtocolError
from burncoll.transport.base import Buffer

__all__ = ["FrameError", "FrameHeader", "FrameReader", "close_payload", "encode_frame",
           "frame_header", "mask_in_place", "parse_close", "unmasked"]

OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
OPCODES = frozenset((OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG))
CLOSE_NORMAL, CLOSE_PROTOCOL, CLOSE_UNSUPPORTED, CLOSE_TOO_BIG = 1000, 1002, 1003, 1009
#: The largest payload of a control frame (section 5.5).
MAX_CONTROL_PAYLOAD = 125
#: The most bytes of a close frame's reason this side sends.
MAX_CLOSE_REASON = 120


class FrameError(ProtocolError):
    """The peer broke the framing; ``code`` is the close code it is told."""

    def __init__(self, message: str, code: int = CLOSE_PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


#: One frame's header, checked: ``(fin, opcode, key, size, length)`` -- whether the frame is
#: its message's last, its opcode, its masking key (``None``: unmasked), the payload bytes it
#: announces, and the bytes of the header itself (2 to 14). A plain tuple: one is made per
#: frame, and a NamedTuple's would cost more than parsing the header.
FrameHeader = tuple[bool, int, bytes | None, int, int]


class FrameReader:
    """The receiving side of the framing on one connection: each frame's header parsed and
    checked (:meth:`header`), the frames of a fragmented message joined (:meth:`add`).

    Args:
        server: this side is the server (it must receive masked frames, a client unmasked
            ones).
        limit: the most bytes an incoming message may have.
    """

    __slots__ = ("fragments", "limit", "message_bytes", "remote", "server")

    def __init__(self, *, server: bool, limit: int) -> None:
        self.server = server
        self.limit = limit
        #: The other end's ``"host:port"``, named in every refusal.
        self.remote = "?"
        #: The payloads of the fragmented message in progress; ``None`` when none is.
        self.fragments: list[bytes | memoryview] | None = None
        #: Their bytes so far.
        self.message_bytes = 0

    def header(self, view: memoryview) -> FrameHeader | None:
        """The header at the start of ``view``, or ``None`` when ``view`` does not hold all of
        it yet; :class:`FrameError` when the frame breaks the rules (module docstring)."""
        if len(view) < 2:
            return None
        first, second = view[0], view[1]
        size = second & 0x7F
        at = 2
        if size == 126:
            if len(view) < 4:
                return None
            size, at = int.from_bytes(view[2:4], "big"), 4
        elif size == 127:
            if len(view) < 10:
                return None
            size, at = int.from_bytes(view[2:10], "big"), 10
        key = None
        if second & 0x80:
            if len(view) < at + 4:
                return None
            key, at = bytes(view[at:at + 4]), at + 4
        fin, opcode = bool(first & 0x80), first & 0x0F
        self._check(first & 0x70, opcode, key is not None, fin, size)
        return fin, opcode, key, size, at

    def _check(self, rsv: int, opcode: int, masked: bool, fin: bool, size: int) -> None:
        remote = self.remote
        if rsv:
            raise FrameError(f"{remote} set reserved bits (no extension was negotiated)",
                             CLOSE_PROTOCOL)
        if opcode not in OPCODES:
            raise FrameError(f"{remote} sent a frame with reserved opcode {opcode:#x}",
                             CLOSE_PROTOCOL)
        if masked != self.server:
            raise FrameError(f"{remote} sent {'an unmasked' if self.server else 'a masked'} "
                             "frame (RFC 6455 section 5.1)", CLOSE_PROTOCOL)
        if opcode >= OP_CLOSE:
            if not fin or size > MAX_CONTROL_PAYLOAD:
                raise FrameError(f"{remote} sent a fragmented or oversized control frame",
                                 CLOSE_PROTOCOL)
            return
        if opcode == OP_TEXT:
            raise FrameError(f"{remote} sent a text message; burncoll speaks binary",
                             CLOSE_UNSUPPORTED)
        if (opcode == OP_CONTINUATION) != (self.fragments is not None):
            raise FrameError(f"{remote} broke a fragmented message's sequence", CLOSE_PROTOCOL)
        total = self.message_bytes + size
        if total > self.limit:
            raise FrameError(
                f"message from {remote} exceeds the size limit ({total} bytes announced, "
                f"limit {self.limit})", CLOSE_TOO_BIG)

    def add(self, payload: bytes | memoryview, fin: bool) -> bytes | None:
        """Add a data frame's ``payload`` (kept as it is: the caller's to leave alone) to the
        fragmented message; the whole message at its last frame (``fin``), else ``None``."""
        if self.fragments is None:
            self.fragments, self.message_bytes = [], 0
        self.fragments.append(payload)
        self.message_bytes += len(payload)
        if not fin:
            return None
        message = b"".join(self.fragments)
        self.fragments, self.message_bytes = None, 0
        return message


def mask_in_place(data: memoryview, key: bytes) -> None:
    """XOR ``data`` with the 4-byte masking ``key`` repeated (RFC 6455 section 5.3); masking
    and unmasking are the same operation. Eight bytes at a time, through NumPy."""
    array = np.frombuffer(data, dtype=np.uint8)
    words = len(array) // 8
    if words:
        array[: words * 8].view(np.uint64)[...] ^= np.frombuffer(key * 2, dtype=np.uint64)[0]
    for i in range(words * 8, len(array)):
        array[i] ^= key[i % 4]


def unmasked(payload: memoryview, key: bytes | None) -> memoryview:
    """``payload`` itself when unmasked (``key`` ``None``), else an unmasked copy of it."""
    if key is None:
        return payload
    copy = memoryview(bytearray(payload))
    mask_in_place(copy, key)
    return copy


def frame_header(opcode: int, size: int, mask: bytes | None, fin: bool = True) -> bytes:
    """The header of one frame of ``size`` payload bytes (with its masking key when given),
    its length in the shortest encoding."""
    first = (0x80 if fin else 0) | opcode
    flag = 0x80 if mask is not None else 0
    if size < 126:
        head = bytes((first, flag | size))
    elif size < 1 << 16:
        head = bytes((first, flag | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, flag | 127)) + size.to_bytes(8, "big")
    return head + mask if mask is not None else head


def encode_frame(opcode: int, parts: Sequence[Buffer], mask: bytes | None) -> bytearray:
    """One whole frame (FIN set) of ``parts`` joined: copied once, into the frame's own
    buffer, and masked there when ``mask`` is given."""
    views = [memoryview(p).cast("B") for p in parts]
    size = sum(len(v) for v in views)
    header = frame_header(opcode, size, mask)
    frame = bytearray(len(header) + size)
    frame[:len(header)] = header
    at = len(header)
    for view in views:
        frame[at:at + len(view)] = view
        at += len(view)
    if mask is not None:
        mask_in_place(memoryview(frame)[len(header):], mask)
    return frame


def close_payload(code: int, reason: str = "") -> bytes:
    """A close frame's payload: the code, then at most :data:`MAX_CLOSE_REASON` bytes of
    ``reason`` (section 5.5.1)."""
    return code.to_bytes(2, "big") + reason.encode()[:MAX_CLOSE_REASON]


def parse_close(payload: memoryview) -> tuple[int, str]:
    """``(code, reason)`` of a close frame's payload; an empty one means 1000 (normal)."""
    code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else CLOSE_NORMAL
    return code, bytes(payload[2:]).decode(errors="replace")
