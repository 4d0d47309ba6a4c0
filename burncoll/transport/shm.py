"""Shared memory between two nodes of one host: large messages through a sealed ring,
everything else -- order, small messages, liveness -- through their own connection.

Node processes of one machine (``burncoll launch --nodes 4``, torchrun's one process per
device) otherwise push every array through the kernel's TCP stack. When the orchestrator's
table says two nodes share a host (:func:`host_identity`: same kernel boot, same network and
process namespaces, and sealed anonymous files work here), the sending side of their data
connection creates a ring (an anonymous ``memfd`` of :data:`RING_BYTES`, its pages mapped at
once, *sealed* so that nobody -- its creator included -- can shrink or grow it) and offers it
on the connection as ``pid/fd/token``; the receiving side opens it through ``/proc``, checks
that it is a regular file of this user, of exactly the ring's size, sealed, and named with
the offered random token, and maps it read-only. From then on a message of at least
:data:`MIN_BYTES` is copied into the ring and only a 12-byte descriptor (its length) travels
on the connection, in order with every other message; the receiver copies it out --
straight into the memory its placer chose -- or, where no place was chosen, lends it where it
lies until its next ``recv`` (a :class:`~burncoll.transport.wire.Placed` with ``lent``: the
node combines a part it reduces straight out of the ring, and copies anything else out), and
acknowledges the bytes it consumed, a quarter ring at a time, which the sender may then
overwrite. That is one copy on each side at most and no system call per byte, as NCCL's SHM
transport and Open MPI's shared-memory component do.

The seals are why a member holding the token cannot crash its receiver: a file that can be
shrunk under a mapping makes the next read of the missing pages fail with ``SIGBUS``, which
kills the process; a sealed one cannot be shrunk at all. An anonymous file also leaves
nothing behind: it is gone when the last process holding it ends.

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
import fcntl
import functools
import hashlib
import mmap
import os
import re
import secrets
import stat
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.base import Buffer, Connection, FastPath, Placer, byte_view
from burncoll.transport.wire import FIXED_HEADER_BYTES, MAX_NDIM, Placed

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
#: token in the ring's name (``/proc/PID/fd/FD`` must lead to ``memfd:burncoll-TOKEN``).
_OFFERED = re.compile(r"([0-9]{1,10})/([0-9]{1,10})/([0-9a-f]{32})")
#: A ring's seals: its size is fixed for good (no ``SIGBUS`` from a shrunk file), and no
#: other seal can be added.
#: (0 where the platform has no seals: then :func:`host_identity` says no ring is possible.)
_SEALS: int = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
               | getattr(fcntl, "F_SEAL_SEAL", 0))
_OFFER, _DATA, _ACK = b"BSO1", b"BSD1", b"BSA1"
_LENGTH = struct.Struct("<Q")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: The most bytes a message's header takes (what a placer reads of it).
_HEADER_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM
#: Seconds a receiver reads on after its ring could not be mapped (see :class:`RingReceiver`).
UNMAPPED_GRACE = 1.0


@functools.cache
def host_identity() -> str:
    """What two processes share exactly when they can share a ring: the kernel's boot id and
    the network and process namespaces (``""`` where any is unknown, or where this process
    cannot make a sealed ring and reach it through ``/proc``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        pids = os.stat("/proc/self/ns/pid").st_ino
        _probe_sealed_ring()
    except (OSError, AttributeError):
        return ""
    text = f"{boot}:{net}:{pids}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _probe_sealed_ring() -> None:
    """Make a tiny sealed anonymous file and open it as a receiver would (``OSError`` where
    that fails: no shared memory here)."""
    if not _SEALS:
        raise OSError("this platform cannot seal a file's size")
    fd = _sealed_file("burncoll-probe", 4096)
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_PATH))
    finally:
        os.close(fd)


def _sealed_file(name: str, size: int) -> int:
    """A new anonymous file of ``size`` bytes that can never change size; its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        #: The ring's descriptor, open until the receiver has mapped it (its first
        #: acknowledgement), and the name it was offered by.
        self._fd: int | None = None
        self._offer = ""
        self._map: mmap.mmap | None = None
        self._ring = memoryview(b"")
        self._offered = False
        self._position = 0
        self._unacked = 0
        self._room = asyncio.Event()
        self._broken: BaseException | None = None
        self._busy = threading.Lock()  # held while a message goes through the ring

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [byte_view(p) for p in parts]
        size = sum(len(v) for v in views)
        if not MIN_BYTES <= size <= MAX_BYTES:
            await self.inner.send(views)
            return
        if not self._offered:  # the ring is made when the first large message needs it
            self._create()
            await self.inner.send([_OFFER + _LENGTH.pack(RING_BYTES) + self._offer.encode()])
            self._offered = True
        with self._busy:
            start, used = _advance(self._position, size)
            while self._unacked + used > RING_BYTES:
                if self._broken is not None:
                    raise TransportError(f"connection to {self.remote} is closed") from None
                self._room.clear()
                await self._room.wait()
            at = start
            for view in views:
                self._ring[at:at + len(view)] = view
                at += len(view)
            self._position, self._unacked = at, self._unacked + used
            await self.inner.send([_DATA + _LENGTH.pack(size)])

    async def recv(self) -> Buffer | Placed:
        while True:
            try:
                message = await self.inner.recv()
            except BaseException as exc:
                self._broken = exc
                self._room.set()
                raise
            if isinstance(message, Placed) or bytes(message[:4]) != _ACK:
                return message
            freed = _LENGTH.unpack_from(message, 4)[0] if len(message) == 12 else -1
            if not 0 < freed <= self._unacked:
                raise ProtocolError(f"acknowledged {freed} bytes of a ring that holds "
                                    f"{self._unacked} unread")
            self._unacked -= freed
            self._room.set()
            self._forget()  # the receiver has mapped it: the descriptor is no longer needed

    def _create(self) -> None:
        token = secrets.token_hex(16)
        fd = _sealed_file(f"burncoll-{token}", RING_BYTES)
        try:
            # every page now, once: not a page fault per message until the ring first wraps
            self._map = mmap.mmap(fd, RING_BYTES, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._offer = fd, f"{os.getpid()}/{fd}/{token}"
        self._ring = memoryview(self._map)

    def _forget(self) -> None:
        """Close the ring's descriptor (the mapping stays): once the receiver has mapped
        it, nothing else may open it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def send_now(self, parts: Sequence[Buffer]) -> bool:
        if self._fast is None or not self._busy.acquire(blocking=False):
            return False
        try:  # (small messages only: the inner connection decides)
            return self._fast.send_now(parts)
        finally:
            self._busy.release()

    def place_with(self, placer: Placer) -> None:
        if self._fast is not None:
            self._fast.place_with(placer)

    def stop_placing(self) -> None:
        if self._fast is not None:
            self._fast.stop_placing()

    async def close(self) -> None:
        self._broken = self._broken or TransportError("closed")
        self._room.set()
        if not self._offered:
            self._forget()
        # else the descriptor stays open until this process ends: the receiver may still
        # have the offer to read (a failing node closes right after its abort, which follows
        # the offer); closing it would let the number name another file of this process
        await self.inner.close()
        with contextlib.suppress(BufferError, ValueError):
            self._ring.release()
            if self._map is not None:
                self._map.close()

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()


class RingReceiver(Connection, FastPath):
    """The receiving side: maps the ring its sender offers, reads messages out of it.

    A ring that cannot be mapped dooms the connection, but not at once: only its sender
    removes its name before the receiver maps it, when it closes after a failure (or dies),
    and what it said before closing -- why it failed -- follows the offer on the connection.
    So the receiver reads on for up to :data:`UNMAPPED_GRACE` seconds, dropping the
    descriptors of the missing ring and returning every other message, then fails with the
    reason the ring could not be mapped (at once when the connection ends first).
    """

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.remote = inner.remote
        self._fast = inner if isinstance(inner, FastPath) else None
        self._ring: memoryview | None = None
        self._map: mmap.mmap | None = None
        self._position = 0
        self._consumed = 0  # bytes read out of the ring and not acknowledged yet
        self._placer: Placer | None = None
        #: Why the offered ring could not be mapped, and when reading on for the sender's
        #: last words ends (event-loop time).
        self._unmapped: TransportError | None = None
        self._give_up_at = 0.0
        #: Ring bytes of the message last lent, read once the next one is asked for.
        self._lent = 0

    async def recv(self) -> Buffer | Placed:
        if self._lent:
            used, self._lent = self._lent, 0
            await self._release(used)
        while True:
            message = await self._next()
            if isinstance(message, Placed):
                return message
            tag = bytes(message[:4])
            if tag == _OFFER:
                self._map_ring(byte_view(message))
                continue
            if tag != _DATA:
                return message
            if self._unmapped is not None:
                continue  # (a message of the ring that is gone)
            return await self._take(byte_view(message))

    async def _next(self) -> Buffer | Placed:
        if self._unmapped is None:
            return await self.inner.recv()
        remaining = self._give_up_at - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                return await self.inner.recv()
        except (TimeoutError, TransportError):
            raise self._unmapped from None

    def _map_ring(self, message: memoryview) -> None:
        offered = bytes(message[12:]).decode("ascii", "replace")
        size = _LENGTH.unpack_from(message, 4)[0] if len(message) >= 12 else -1
        match = _OFFERED.fullmatch(offered)
        if (self._ring is not None or self._unmapped is not None or size != RING_BYTES
                or match is None):
            raise ProtocolError("offered a shared-memory ring this node does not accept")
        pid, fd, token = match.groups()
        try:
            # O_PATH: find the file without opening it (no device is ever opened on an
            # offer's word), then check it is the ring that was offered
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH)
        except OSError as exc:  # (its sender has ended, or it is not on this host after all)
            self._unmapped = TransportError(f"could not map the shared-memory ring {offered} "
                                            f"offered by {self.remote}: {exc}")
            self._give_up_at = asyncio.get_running_loop().time() + UNMAPPED_GRACE
            return
        try:
            self._map_checked(handle, token)
        finally:
            os.close(handle)

    def _map_checked(self, handle: int, token: str) -> None:
        """Map the file ``handle`` finds if it is the offered ring: a regular anonymous file
        of this user named with ``token``, of the ring's size, sealed against resizing."""
        name = os.readlink(f"/proc/self/fd/{handle}")
        if name not in (f"/memfd:burncoll-{token} (deleted)", f"/memfd:burncoll-{token}"):
            raise ProtocolError("offered a shared-memory ring that is not the one it names")
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise ProtocolError("offered a shared-memory ring that is not a regular file")
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY)
        try:
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise ProtocolError("offered a shared-memory ring that could still be resized "
                                    "(a shrunk ring would crash this process)")
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_size != RING_BYTES:
                raise ProtocolError("offered a shared-memory ring of another user or size")
            self._map = mmap.mmap(fd, RING_BYTES, flags=mmap.MAP_SHARED | _POPULATE,
                                  prot=mmap.PROT_READ)
            self._ring = memoryview(self._map)
        finally:
            os.close(fd)

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

    def send_now(self, parts: Sequence[Buffer]) -> bool:
        return self._fast is not None and self._fast.send_now(parts)

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
        with contextlib.suppress(BufferError, ValueError):
            if self._ring is not None and self._map is not None:
                self._ring.release()
                self._map.close()

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()
