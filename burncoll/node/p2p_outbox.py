"""Point-to-point messages this node sends: their frames, numbers and acknowledgements.

A message from rank ``src`` to rank ``dst`` under ``tag`` (its *key*) gets the next number of
that key, counted from 0 -- the receiver expects exactly that one
(:mod:`burncoll.node.inbox`). :func:`message_parts` cuts it into DATA frames of op kind
:attr:`~burncoll.ops.OpKind.P2P`. The receiving node acknowledges each message once a recv
took it, or refused it (:class:`~burncoll.protocol.members.P2PAck`); the :class:`Outbox`
holds a future per message sent and not acknowledged yet, and checks every acknowledgement:
only the node the message went to may acknowledge it, only once, and in the order the key's
messages were sent (a receiver takes them in that order). Anything else is a
:class:`~burncoll.ProtocolError`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from burncoll.dtypes import dtype_name
from burncoll.errors import ProtocolError
from burncoll.levels import HostArray
from burncoll.node.inbox import P2PKey
from burncoll.node.mailbox import PART_BYTES
from burncoll.ops import OpKind
from burncoll.protocol.members import P2PAck
from burncoll.protocol.wire import DataHeader, encode_data_header
from burncoll.transport.base import Buffer

__all__ = ["Outbox", "message_parts"]


def message_parts(session: int, node: int, key: P2PKey, seq: int, buf: HostArray,
                  part_bytes: int = PART_BYTES) -> Iterator[list[Buffer]]:
    """The frames of message ``seq`` of ``key`` holding ``buf`` (at least one, in order),
    sent by ``node``: each a DATA header and a part of ``buf``'s bytes (no copy of a
    C-contiguous ``buf``)."""
    src, dst, tag = key
    shape = tuple(buf.shape)  # (np.ascontiguousarray makes a 0-d array 1-d)
    array = np.ascontiguousarray(buf)
    raw = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    total, offset = raw.nbytes, 0
    while True:
        end = min(offset + part_bytes, total)
        header = DataHeader(
            session=session, seq=seq, op_kind=OpKind.P2P, reduce_op=None,
            dtype=dtype_name(array.dtype), shape=shape, root=dst, src=node,
            round=0, channel=tag, chunk=src, offset=offset, chunk_bytes=total)
        yield [encode_data_header(header, end - offset), raw[offset:end]]
        offset = end
        if offset >= total:
            return


@dataclass(frozen=True, slots=True)
class _Sent:
    """A message sent and not acknowledged yet: its number, its destination node, and the
    future its sender awaits (the refusal's reason, or ``None`` when taken)."""

    seq: int
    node: int
    acked: asyncio.Future[str | None]


class Outbox:
    """The messages this node sent and awaits acknowledgements of (on the event loop)."""

    def __init__(self) -> None:
        self._next: dict[P2PKey, int] = {}
        self._sent: dict[P2PKey, deque[_Sent]] = {}
        self._error: BaseException | None = None

    def open(self, key: P2PKey, node: int) -> tuple[int, asyncio.Future[str | None]]:
        """A new message of ``key`` to ``node``: its number, and the future its
        acknowledgement completes. Raises the session's failure, if any."""
        if self._error is not None:
            raise self._error
        seq = self._next.get(key, 0)
        self._next[key] = seq + 1
        acked: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._sent.setdefault(key, deque()).append(_Sent(seq, node, acked))
        return seq, acked

    def close(self, key: P2PKey, seq: int) -> None:
        """Its sender stopped waiting for message ``seq`` of ``key`` (acknowledged or not)."""
        sent = self._sent.get(key)
        if sent is None:
            return
        for entry in [e for e in sent if e.seq == seq]:
            sent.remove(entry)
        if not sent:
            del self._sent[key]

    def took(self, ack: P2PAck, node: int) -> None:
        """``node`` acknowledged a message; :class:`~burncoll.ProtocolError` (worded "sent
        ...") unless it is the oldest message of its key awaiting one from ``node``."""
        if self._error is not None:
            return
        if ack.node != node:
            raise ProtocolError(f"sent an acknowledgement in the name of node {ack.node}")
        key = (ack.src, ack.dst, ack.tag)
        sent = self._sent.get(key)
        first = sent[0] if sent else None
        if sent is None or first is None or (first.seq, first.node) != (ack.seq, node):
            raise ProtocolError(
                f"sent an acknowledgement of message #{ack.seq} from rank {ack.src} to rank "
                f"{ack.dst} (tag {ack.tag}), which this node is not waiting for from it: a "
                "forged, repeated or out-of-order acknowledgement")
        sent.popleft()
        if not sent:
            del self._sent[key]
        if not first.acked.done():
            first.acked.set_result(ack.refused)

    def fail(self, error: BaseException) -> None:
        """End the session: every sender waiting for an acknowledgement raises ``error``."""
        if self._error is not None:
            return
        self._error = error
        for sent in self._sent.values():
            for entry in sent:
                if not entry.acked.done():
                    entry.acked.set_exception(error)
                    entry.acked.exception()  # retrieved: its sender may have stopped waiting
        self._sent.clear()
