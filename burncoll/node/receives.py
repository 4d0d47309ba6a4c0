"""What a node receives in one operation: the keys of its frames and the size of each chunk.

A frame's key is ``(seq, channel, round, src, chunk)``; :class:`Receives` is what one lane
(one channel of one operation) registers with the mailbox when it starts, so that every frame
is checked against it before anything is stored or allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from burncoll.errors import ProtocolError
from burncoll.protocol.wire import DataHeader

__all__ = [
    "PART_BYTES",
    "FrameKey",
    "OpChannel",
    "Receives",
    "Stream",
    "accept_part",
    "describe_part",
    "key_of",
]

FrameKey = tuple[int, int, int, int, int]
#: ``(seq, channel)``: one channel of one operation, started by one
#: :meth:`Mailbox.expect <burncoll.node.mailbox.Mailbox.expect>`.
OpChannel = tuple[int, int]

#: Largest payload of one frame; bigger chunks travel in several parts.
PART_BYTES = 4 << 20


def key_of(h: DataHeader) -> FrameKey:
    return (h.seq, h.channel, h.round, h.src, h.chunk)


def describe_part(h: DataHeader) -> str:
    return (f"the part at byte {h.offset} of chunk {h.chunk} of operation #{h.seq} "
            f"(round {h.round + 1})")


def _derived_elsewhere(h: DataHeader) -> int:
    raise ProtocolError(f"sent {describe_part(h)}, a chunk of unknown size")


@dataclass(frozen=True, slots=True)
class Receives:
    """What one lane of this node receives: each key, and its chunk's size in bytes.

    ``None`` as a size: the chunk is allocated on receipt, its size follows from the first
    header's dtype and shape: ``size_of(header)`` (which raises ProtocolError for a shape this
    node cannot hold).
    """

    seq: int
    channel: int
    totals: Mapping[FrameKey, int | None]
    size_of: Callable[[DataHeader], int] = field(default=_derived_elsewhere)
    #: Bytes of every part but a chunk's last (the sender's ``PART_BYTES``).
    part_bytes: int = PART_BYTES


class Stream:
    """What arrived of one key: its chunk's size and the bytes received in order."""

    __slots__ = ("complete", "received", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.received = 0
        self.complete = False


def accept_part(streams: dict[FrameKey, Stream], h: DataHeader, size: int,
                receives: Receives | None) -> None:
    """Advance the key of ``h`` by its part of ``size`` bytes, or raise ProtocolError.

    ``receives``: the started lane's registration (every check); ``None`` for a lane not
    started: the part is checked for order and an upper bound on its size only (the exact
    checks run when the lane starts).
    """
    key = key_of(h)
    stream = streams.get(key)
    if stream is None:
        if receives is None:
            total = h.chunk_bytes
        elif key not in receives.totals:
            raise ProtocolError(
                f"sent {describe_part(h)}, which this node does not receive in that operation "
                "(no such round, sender or chunk in its schedule)")
        else:
            registered = receives.totals[key]
            total = receives.size_of(h) if registered is None else registered
        if h.chunk_bytes != total:
            raise ProtocolError(
                f"sent {describe_part(h)} announcing a chunk of {h.chunk_bytes} bytes where this "
                f"node expects {total}")
        stream = Stream(total)
        streams[key] = stream
    elif h.chunk_bytes != stream.total:
        raise ProtocolError(
            f"sent {describe_part(h)} announcing a chunk of {h.chunk_bytes} bytes after parts of "
            f"a chunk of {stream.total}")
    if stream.complete or h.offset < stream.received:
        raise ProtocolError(
            f"sent {describe_part(h)} twice, or bytes overlapping a part already received (byte "
            f"{stream.received} of {stream.total} comes next)")
    if h.offset > stream.received:
        raise ProtocolError(
            f"sent {describe_part(h)} out of order: byte {stream.received} comes next (the parts "
            "of a chunk follow each other, without gaps)")
    part = receives.part_bytes if receives is not None else PART_BYTES
    want = min(part, stream.total - h.offset)
    fits = size == want if receives is not None else (
        size <= want and (size > 0 or want == 0))
    if not fits:
        raise ProtocolError(
            f"sent {describe_part(h)} of {size} bytes where the schedule has {want}")
    stream.received += size
    stream.complete = stream.received >= stream.total
