"""Shared memory between two nodes of one host: large messages through a ring in ``/dev/shm``,
everything else -- order, small messages, liveness -- through their own connection.

Node processes of one machine (``burncoll launch --nodes 4``, torchrun's one process per
device) otherwise push every array through the kernel's TCP stack. When the orchestrator's
table says two nodes share a host (:func:`host_identity`: same kernel boot, same network
namespace, same ``/dev/shm``), the sending side of their data connection creates a ring (a
file of :data:`RING_BYTES` in ``/dev/shm``, mode 0600, its name random, its pages mapped at
once) and offers it on the
connection; the receiving side maps it and removes its name at once. From then on a message of
at least :data:`MIN_BYTES` is copied into the ring and only a 12-byte descriptor (its length)
travels on the connection, in order with every other message; the receiver copies it out --
straight into the memory its placer chose -- or, where no place was chosen, lends it where it
lies until its next ``recv`` (a :class:`~burncoll.transport.wire.Placed` with ``lent``: the
node combines a part it reduces straight out of the ring, and copies anything else out), and
acknowledges the bytes it consumed, a quarter ring at a time, which the sender may then
overwrite. That is one copy on each side at most and no system call per byte, as NCCL's SHM
transport and Open MPI's shared-memory component do.

The connection keeps everything else: a process that dies closes it (``PeerLost`` at once, as
over the network), deadlines are the caller's, a sender waits for ring space only while its
receiver has not consumed (the backpressure of a paused reader reaches it as before), and no
byte is read twice or before it was written (the positions are the two sides' own, in
lockstep; a descriptor carries only a length, checked against the ring). Nodes in different
network namespaces (the simulated hosts of the multi-host tests) never share a ring.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import mmap
import os
import re
import secrets
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
_DIR = Path("/dev/shm")
_NAME = re.compile(r"burncoll-([0-9]{1,10})-[0-9a-f]{32}")
_OFFER, _DATA, _ACK = b"BSO1", b"BSD1", b"BSA1"
_LENGTH = struct.Struct("<Q")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: The most bytes a message's header takes (what a placer reads of it).
_HEADER_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM
#: Seconds a receiver reads on after its ring could not be mapped (see :class:`RingReceiver`).
UNMAPPED_GRACE = 1.0


def host_identity() -> str:
    """What two processes share exactly when they can share a ring: the kernel's boot id,
    the network namespace and the ``/dev/shm`` mount (``""`` where any is unknown)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        shm = os.stat(_DIR)
    except OSError:
        return ""
    text = f"{boot}:{net}:{shm.st_dev}:{shm.st_ino}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _advance(position: int, size: int) -> tuple[int, int]:
    """Where a message of ``size`` bytes starts in the ring when the last one ended at
    ``position`` (at 0 when it would not fit before the end), and the bytes it uses up."""
    if position + size > RING_BYTES:
        return 0, RING_BYTES - position + size
    return position, size


#: The rings this process created whose names are still there.
_ours: set[Path] = set()


@atexit.register
def _remove_ours() -> None:
    for path in list(_ours):
        with contextlib.suppress(OSError):
            path.unlink()


def _sweep() -> None:
    """Remove the rings of processes of this user that died before their receiver mapped
    them (a ring's name holds its creator's pid): a crash leaves nothing behind for long."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(_DIR):
            match = _NAME.fullmatch(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # alive (or not ours to signal): leave it
            except ProcessLookupError:
                pass
            except OSError:
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)


class RingSender(Connection, FastPath):
    """The sending side of a data connection to a node of the same host (see the module)."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.remote = inner.remote
        self._fast = inner if isinstance(inner, FastPath) else None
        self._path: Path | None = None
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
            assert self._path is not None
            await self.inner.send([_OFFER + _LENGTH.pack(RING_BYTES) + self._path.name.encode()])
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
            self._unlink()  # the receiver has mapped it: the name is no longer needed

    def _create(self) -> None:
        _sweep()
        self._path = _DIR / f"burncoll-{os.getpid()}-{secrets.token_hex(16)}"
        _ours.add(self._path)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, RING_BYTES)
            # every page now, once: not a page fault per message until the ring first wraps
            self._map = mmap.mmap(fd, RING_BYTES, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self._ring = memoryview(self._map)

    def _unlink(self) -> None:
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
            _ours.discard(self._path)
            self._path = None

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
            self._unlink()
        # else the name stays: the receiver may still have the offer to read (a failing node
        # closes right after its abort, which follows the offer); it removes the name when it
        # maps the ring, and this process does at exit (_remove_ours) if it never did
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
        name = bytes(message[12:]).decode("ascii", "replace")
        size = _LENGTH.unpack_from(message, 4)[0] if len(message) >= 12 else -1
        if (self._ring is not None or self._unmapped is not None or size != RING_BYTES
                or not _NAME.fullmatch(name)):
            raise ProtocolError("offered a shared-memory ring this node does not accept")
        path = _DIR / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:  # (its sender closed it, or it is not on this host after all)
            self._unmapped = TransportError(f"could not map the shared-memory ring {name} "
                                            f"offered by {self.remote}: {exc}")
            self._give_up_at = asyncio.get_running_loop().time() + UNMAPPED_GRACE
            return
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_size != RING_BYTES:
                raise ProtocolError("offered a shared-memory ring of another user or size")
            self._map = mmap.mmap(fd, RING_BYTES, flags=mmap.MAP_SHARED | _POPULATE,
                                  prot=mmap.PROT_READ)
            self._ring = memoryview(self._map)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()  # the name goes now: nothing is left behind if a process dies

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
