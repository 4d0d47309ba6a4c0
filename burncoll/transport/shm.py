"""Shared memory between two nodes of one host: large messages through a stream region of the
sender's host memory, everything else -- order, small messages, liveness -- through their own
connection.

Node processes of one machine (``burncoll launch --nodes 4``, torchrun's one process per
device) otherwise push every array through the kernel's TCP stack. Where the node processes
of one host share their host memory (:mod:`burncoll.node.host_memory`, set up by one
handshake at join), each node's mapping holds one *stream region* of :data:`RING_BYTES` per
other node, which only it writes and only that node reads (mapped read-only there, sealed at
its size: :mod:`burncoll.transport.host_files`). The node hands each connection's wrapper
its region at join (:meth:`RingSender.attach`, :meth:`RingReceiver.attach`); before that, or
without one, everything stays on the connection. A message of :data:`MIN_BYTES` to
:data:`MAX_BYTES` is then copied into the region and only a 12-byte descriptor (its length)
travels on the connection, in order with every other message; the receiver copies it out --
straight into the memory its placer chose -- or, where no place was chosen, lends it where it
lies until its next ``recv`` (a :class:`~burncoll.protocol.wire.Placed` with ``lent``: the
node combines a part it reduces straight out of the region, and copies anything else out),
and acknowledges the bytes it consumed, a quarter region at a time, which the sender may then
overwrite. That is one copy on each side at most and no system call per byte, as NCCL's SHM
transport and Open MPI's shared-memory component do.

The connection keeps everything else: a process that dies closes it (``PeerLost`` at once, as
over the network), deadlines are the caller's, a sender waits for room only while its
receiver has not consumed (the backpressure of a paused reader reaches it as before), and no
byte is read twice or before it was written (the positions are the two sides' own, in
lockstep; a descriptor carries only a length, checked against the region).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Sequence

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import FIXED_HEADER_BYTES, MAX_NDIM, Placed
from burncoll.transport.base import Buffer, Connection, FastPath, Placer, byte_view

__all__ = ["MIN_BYTES", "RING_BYTES", "RingReceiver", "RingSender"]

#: Size of a stream region (one direction): four of a collective's largest messages (4 MiB
#: parts).
RING_BYTES = 20 << 20
#: Messages at least this large go through the region; smaller ones stay on the connection.
MIN_BYTES = 64 << 10
#: The largest message a region carries (bigger ones stay on the connection; a collective's
#: parts are at most 4 MiB).
MAX_BYTES = RING_BYTES // 4
#: A receiver acknowledges consumed bytes once this many have gathered (one small message per
#: quarter region, not one per message). Why a sender short of room always gets one: a message
#: uses at most ``2 * MAX_BYTES`` of the region (itself, and the end it skips), so the sender
#: waits only while more than half the region is unacknowledged -- more than a quarter of it then
#: still unread, and reading it brings the receiver's count past ``ACK_BYTES``.
ACK_BYTES = RING_BYTES // 4
_DATA, _ACK = b"BSD1", b"BSA1"
_LENGTH = struct.Struct("<Q")
#: The most bytes a message's header takes (what a placer reads of it).
_HEADER_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM


def _advance(position: int, size: int) -> tuple[int, int]:
    """Where a message of ``size`` bytes starts in the region when the last one ended at
    ``position`` (at 0 when it would not fit before the end), and the bytes it uses up."""
    if position + size > RING_BYTES:
        return 0, RING_BYTES - position + size
    return position, size


class RingSender(Connection, FastPath):
    """The sending side of a data connection to a node of the same host (see the module)."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.remote = inner.remote
        self._fast = inner if isinstance(inner, FastPath) else None
        #: This node's stream region to the receiver (writable), once handed in at join.
        self._region: memoryview | None = None
        self._position = 0
        self._unacked = 0
        self._room = asyncio.Event()
        self._broken: BaseException | None = None

    def attach(self, region: memoryview) -> None:
        """(At join, before the first message through it.) The stream region to write."""
        self._region = region

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [byte_view(p) for p in parts]
        size = sum(len(v) for v in views)
        region = self._region
        if region is None or not MIN_BYTES <= size <= MAX_BYTES:
            await self.inner.send(views)
            return
        start, used = _advance(self._position, size)
        while self._unacked + used > RING_BYTES:
            self._check_open()
            self._room.clear()
            await self._room.wait()
        at = start
        for view in views:
            region[at:at + len(view)] = view
            at += len(view)
        self._position, self._unacked = at, self._unacked + used
        await self.inner.send([_DATA + _LENGTH.pack(size)])

    def _check_open(self) -> None:
        if self._broken is not None:
            why = f"{type(self._broken).__name__}: {self._broken}"
            raise TransportError(f"connection to {self.remote} failed ({why})") from None

    async def recv(self) -> Buffer | Placed:
        while True:
            try:
                message = await self.inner.recv()
                if isinstance(message, Placed) or bytes(message[:4]) != _ACK:
                    return message
                self._take_ack(message)
            except BaseException as exc:  # (a sender waiting for room: woken)
                self.abandon(exc)
                raise

    def abandon(self, error: BaseException) -> None:
        """The connection or the session failed: a send waiting for room in the region fails
        now, and so does every later one through the region."""
        self._broken = self._broken or error
        self._room.set()

    def _take_ack(self, message: Buffer) -> None:
        freed = _LENGTH.unpack_from(message, 4)[0] if len(message) == 12 else -1
        if self._region is None or not 0 < freed <= self._unacked:
            raise ProtocolError(f"acknowledged {freed} bytes of a shared-memory region that "
                                f"holds {self._unacked} unread")
        self._unacked -= freed
        self._room.set()

    def place_with(self, placer: Placer) -> None:
        if self._fast is not None:
            self._fast.place_with(placer)

    def stop_placing(self) -> None:
        if self._fast is not None:
            self._fast.stop_placing()

    async def close(self) -> None:
        self.abandon(TransportError("closed"))
        self._region = None  # (the host memory's to unmap)
        await self.inner.close()

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()


class RingReceiver(Connection, FastPath):
    """The receiving side: reads messages out of its sender's stream region (mapped
    read-only), once handed in at join; a descriptor without one fails the connection."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.remote = inner.remote
        self._fast = inner if isinstance(inner, FastPath) else None
        self._region: memoryview | None = None
        self._position = 0
        self._consumed = 0  # bytes read out of the region and not acknowledged yet
        self._placer: Placer | None = None
        #: Region bytes of the message last lent, read once the next one is asked for.
        self._lent = 0

    def attach(self, region: memoryview | None) -> None:
        """(At join, before the sender may write it.) The stream region to read, or none."""
        self._region = region

    async def recv(self) -> Buffer | Placed:
        if self._lent:
            used, self._lent = self._lent, 0
            await self._release(used)
        message = await self.inner.recv()
        if isinstance(message, Placed) or bytes(message[:4]) != _DATA:
            return message
        return await self._take(byte_view(message))

    async def _take(self, message: memoryview) -> Buffer | Placed:
        size = _LENGTH.unpack_from(message, 4)[0] if len(message) == 12 else -1
        if self._region is None or not MIN_BYTES <= size <= MAX_BYTES:
            raise ProtocolError(f"sent a shared-memory message of {size} bytes, which this "
                                "node does not accept")
        start, used = _advance(self._position, size)
        data = self._region[start:start + size]
        self._position = start + size
        # The sender can write the region at any time: the header the placer judges is a copy,
        # and the one delivered with the placed payload is that same copy.
        first = bytes(data[:_HEADER_MAX])
        chosen = self._placer(memoryview(first), size) if self._placer is not None else None
        if chosen is None:  # lent where it lies, until the next recv (no copy here)
            self._lent = used
            return Placed(b"", data, lent=True)
        head, memory = chosen
        memory[:] = data[head:]
        await self._release(used)  # (the sender may overwrite all of data from here on)
        return Placed(first[:head], memory)

    async def _release(self, used: int) -> None:
        """The region's ``used`` bytes were read: acknowledge them, a quarter region at a time."""
        self._consumed += used
        if self._consumed >= ACK_BYTES:
            acknowledged, self._consumed = self._consumed, 0  # (never counted twice)
            # a sender that is gone needs no acknowledgement, and this message may be the
            # last before its abort: the next recv says what happened to the connection
            with contextlib.suppress(TransportError):
                await self.inner.send([_ACK + _LENGTH.pack(acknowledged)])

    async def send(self, parts: Sequence[Buffer]) -> None:
        await self.inner.send(parts)

    def place_with(self, placer: Placer) -> None:
        self._placer = placer
        if self._fast is not None:
            self._fast.place_with(placer)

    def stop_placing(self) -> None:
        self._placer = None
        if self._fast is not None:
            self._fast.stop_placing()

    async def close(self) -> None:
        self._region = None  # (the host memory's to unmap)
        await self.inner.close()

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()
