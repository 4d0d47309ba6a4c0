"""Shared memory between two nodes of one host: large messages through a sealed ring,
everything else -- order, small messages, liveness -- through their own connection.

Node processes of one machine (``burncoll launch --nodes 4``, torchrun's one process per
device) otherwise push every array through the kernel's TCP stack. When the orchestrator's
table says two nodes share a host (:func:`~burncoll.transport.host_files.host_identity`),
the sending side of their data connection creates a ring when its first message of at least
:data:`MIN_BYTES` needs it (an anonymous file of :data:`RING_BYTES` sealed at its size, its
pages mapped at once: :mod:`burncoll.transport.host_files`), offers it on the connection, and
waits for the answer: the receiver maps it -- only if it is a ring a sender makes -- or
declines it (it cannot be reached: its sender has ended, ``/proc`` is closed), and then
everything stays on the connection. Nothing goes through the ring before the answer, and the
sender closes the descriptor it offered once answered (or at close). From then on a large
message is copied into the ring and only a 12-byte descriptor (its length) travels on the
connection, in order with every other message; the receiver copies it out -- straight into
the memory its placer chose -- or, where no place was chosen, lends it where it lies until
its next ``recv`` (a :class:`~burncoll.protocol.wire.Placed` with ``lent``: the node combines
a part it reduces straight out of the ring, and copies anything else out), and acknowledges
the bytes it consumed, a quarter ring at a time, which the sender may then overwrite. That is
one copy on each side at most and no system call per byte, as NCCL's SHM transport and Open
MPI's shared-memory component do.

The connection keeps everything else: a process that dies closes it (``PeerLost`` at once, as
over the network), deadlines are the caller's, a sender waits for ring space only while its
receiver has not consumed (the backpressure of a paused reader reaches it as before), and no
byte is read twice or before it was written (the positions are the two sides' own, in
lockstep; a descriptor carries only a length, checked against the ring). Nodes in different
network or process namespaces (the simulated hosts of the multi-host tests) never share a
ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import secrets
import struct
from collections.abc import Sequence

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import FIXED_HEADER_BYTES, MAX_NDIM, Placed
from burncoll.transport.base import Buffer, Connection, FastPath, Placer, byte_view
from burncoll.transport.host_files import close_host_file, host_identity, map_offered, new_host_file

__all__ = ["MIN_BYTES", "RING_BYTES", "RingReceiver", "RingSender", "host_identity"]

#: Size of one direction's ring: four of a collective's largest messages (4 MiB parts).
RING_BYTES = 20 << 20
#: Messages at least this large go through the ring; smaller ones stay on the connection.
MIN_BYTES = 64 << 10
#: The largest message the ring carries (bigger ones stay on the connection; a collective's
#: parts are at most 4 MiB).
MAX_BYTES = RING_BYTES // 4
#: A receiver acknowledges consumed bytes once this many have gathered (one small message per
#: quarter ring, not one per message). Why a sender short of room always gets one: a message
#: uses at most ``2 * MAX_BYTES`` of the ring (itself, and the end it skips), so the sender
#: waits only while more than half the ring is unacknowledged -- more than a quarter of it then
#: still unread, and reading it brings the receiver's count past ``ACK_BYTES``.
ACK_BYTES = RING_BYTES // 4
#: An offer names the ring as its creator's pid, the ring's descriptor there, and the random
#: token in the ring's name (:func:`~burncoll.transport.host_files.map_offered`).
_OFFERED = re.compile(r"([0-9]{1,10})/([0-9]{1,10})/([0-9a-f]{32})")
_OFFER, _DATA, _ACK = b"BSO1", b"BSD1", b"BSA1"
#: The receiver's answer to an offer: it mapped the ring, or declined it (the sender then
#: sends everything on the connection). No descriptor is sent before the answer.
_MAPPED, _DECLINED = b"BSM1", b"BSN1"
_LENGTH = struct.Struct("<Q")
#: The most bytes a message's header takes (what a placer reads of it).
_HEADER_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM


def _advance(position: int, size: int) -> tuple[int, int]:
    """Where a message of ``size`` bytes starts in the ring when the last one ended at
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
        #: The ring's descriptor, open until the receiver has answered the offer (or the
        #: connection closes), and the name it was offered by.
        self._fd: int | None = None
        self._offer = ""
        self._map: mmap.mmap | None = None
        self._ring = memoryview(b"")
        self._offered = False
        #: The receiver's answer: ``True`` mapped, ``False`` declined, ``None`` not yet.
        self._mapped: bool | None = None
        self._answered = asyncio.Event()
        self._position = 0
        self._unacked = 0
        self._room = asyncio.Event()
        self._broken: BaseException | None = None

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [byte_view(p) for p in parts]
        size = sum(len(v) for v in views)
        if not MIN_BYTES <= size <= MAX_BYTES or self._mapped is False:
            await self.inner.send(views)
            return
        if not await self._ring_taken():  # (declined, or no ring could be made here)
            await self.inner.send(views)
            return
        start, used = _advance(self._position, size)
        while self._unacked + used > RING_BYTES:
            self._check_open()
            self._room.clear()
            await self._room.wait()
        at = start
        for view in views:
            self._ring[at:at + len(view)] = view
            at += len(view)
        self._position, self._unacked = at, self._unacked + used
        await self.inner.send([_DATA + _LENGTH.pack(size)])

    async def _ring_taken(self) -> bool:
        """Whether the receiver mapped the ring: offered when the first large message needs
        it, then the receiver's answer awaited (nothing goes through the ring before it)."""
        if not self._offered:
            self._offered = True
            try:
                self._create()
            except OSError:  # no ring here after all (descriptors, memory): the connection
                self._mapped = False
                return False
            await self.inner.send([_OFFER + _LENGTH.pack(RING_BYTES) + self._offer.encode()])
        while self._mapped is None:
            self._check_open()
            await self._answered.wait()
        return self._mapped

    def _check_open(self) -> None:
        if self._broken is not None:
            why = f"{type(self._broken).__name__}: {self._broken}"
            raise TransportError(f"connection to {self.remote} failed ({why})") from None

    async def recv(self) -> Buffer | Placed:
        while True:
            try:
                message = await self.inner.recv()
                if isinstance(message, Placed):
                    return message
                tag = bytes(message[:4])
                if tag in (_MAPPED, _DECLINED) and len(message) == 4:
                    self._take_answer(tag == _MAPPED)
                elif tag == _ACK:
                    self._take_ack(message)
                else:
                    return message
            except BaseException as exc:  # (a sender waiting for room or an answer: woken)
                self.abandon(exc)
                raise

    def abandon(self, error: BaseException) -> None:
        """The connection or the session failed: a send waiting for ring room or for the
        receiver's answer fails now, and so does every later one through the ring."""
        self._broken = self._broken or error
        self._room.set()
        self._answered.set()

    def _take_answer(self, mapped: bool) -> None:
        if not self._offered or self._mapped is not None:
            raise ProtocolError("answered a shared-memory ring it was not offered")
        self._mapped = mapped
        self._forget()  # mapped or declined: the offered number no longer names the ring
        if not mapped:
            close_host_file(self._ring, self._map)
        self._answered.set()

    def _take_ack(self, message: Buffer) -> None:
        freed = _LENGTH.unpack_from(message, 4)[0] if len(message) == 12 else -1
        if not self._mapped or not 0 < freed <= self._unacked:
            raise ProtocolError(f"acknowledged {freed} bytes of a ring that holds "
                                f"{self._unacked} unread")
        self._unacked -= freed
        self._room.set()

    def _create(self) -> None:
        token = secrets.token_hex(16)
        fd, self._map = new_host_file(token, RING_BYTES)
        self._fd, self._offer = fd, f"{os.getpid()}/{fd}/{token}"
        self._ring = memoryview(self._map)

    def _forget(self) -> None:
        """Close the descriptor the ring was offered by: its number no longer names the ring
        (the mapping stays, with a descriptor of its own until it is closed)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def place_with(self, placer: Placer) -> None:
        if self._fast is not None:
            self._fast.place_with(placer)

    def stop_placing(self) -> None:
        if self._fast is not None:
            self._fast.stop_placing()

    async def close(self) -> None:
        self.abandon(TransportError("closed"))
        # a receiver that has not read the offer yet finds the ring gone and declines it;
        # nothing went through it before its answer, so nothing is lost
        self._forget()
        await self.inner.close()
        close_host_file(self._ring, self._map)

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()


class RingReceiver(Connection, FastPath):
    """The receiving side: maps the ring its sender offers, reads messages out of it.

    It answers every acceptable offer: mapped, or declined where the ring cannot be reached
    (its sender has ended or closed it since, ``/proc`` is closed to this process, no memory
    to map it): the sender then sends everything on the connection, and this side reads on
    -- what a failing sender said before closing follows its offer. An offer that is not one
    a sender makes fails the connection (:func:`~burncoll.transport.host_files.map_offered`).
    """

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.remote = inner.remote
        self._fast = inner if isinstance(inner, FastPath) else None
        self._ring: memoryview | None = None
        self._map: mmap.mmap | None = None
        self._offered = False
        self._position = 0
        self._consumed = 0  # bytes read out of the ring and not acknowledged yet
        self._placer: Placer | None = None
        #: Ring bytes of the message last lent, read once the next one is asked for.
        self._lent = 0

    async def recv(self) -> Buffer | Placed:
        if self._lent:
            used, self._lent = self._lent, 0
            await self._release(used)
        while True:
            message = await self.inner.recv()
            if isinstance(message, Placed):
                return message
            tag = bytes(message[:4])
            if tag == _OFFER:
                await self._answer(byte_view(message))
                continue
            if tag != _DATA:
                return message
            return await self._take(byte_view(message))

    async def _answer(self, message: memoryview) -> None:
        """Map the offered ring, or decline it; tell the sender which."""
        offered = bytes(message[12:]).decode("ascii", "replace")
        size = _LENGTH.unpack_from(message, 4)[0] if len(message) >= 12 else -1
        match = _OFFERED.fullmatch(offered)
        if self._offered or size != RING_BYTES or match is None:
            raise ProtocolError("offered a shared-memory ring this node does not accept")
        self._offered = True
        pid, fd, token = match.groups()
        self._map = map_offered(int(pid), int(fd), token, RING_BYTES)
        if self._map is not None:
            self._ring = memoryview(self._map)
        # a sender that is gone needs no answer: the next recv says what became of it
        with contextlib.suppress(TransportError):
            await self.inner.send([_MAPPED if self._map is not None else _DECLINED])

    async def _take(self, message: memoryview) -> Buffer | Placed:
        size = _LENGTH.unpack_from(message, 4)[0] if len(message) == 12 else -1
        if self._ring is None or not MIN_BYTES <= size <= MAX_BYTES:
            raise ProtocolError(f"sent a shared-memory message of {size} bytes, which this "
                                "node does not accept")
        start, used = _advance(self._position, size)
        data = self._ring[start:start + size]
        self._position = start + size
        # The sender can write the ring at any time: the header the placer judges is a copy,
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
        """The ring's ``used`` bytes were read: acknowledge them, a quarter ring at a time."""
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
        await self.inner.close()
        close_host_file(self._ring, self._map)

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()
