"""Where received DATA frames wait until the operation they belong to asks for them.

Frames are keyed by ``(seq, channel, round, src, chunk)``: a node can receive parts of a later
operation before it starts it (a faster neighbour), and those wait here. Every wait has a
deadline, on the clock the mailbox is given (it reads none of its own); a failure wakes every
waiter with the error.

**Every byte of a receive buffer is written exactly once.** A sender sends the parts of a chunk
in order on one ordered connection, so :meth:`Mailbox.put` holds every key to that schedule:
the first part is at byte 0, each next one starts where the previous one ended, every part
but the last is :attr:`Receives.part_bytes` long (the last one the rest), the chunk's size
(``chunk_bytes``) never changes, and nothing comes after the last part. A part that overlaps
one already received, skips ahead, comes out of order, is sent twice, or belongs to an
operation this node has left behind is a :class:`~burncoll.ProtocolError` (the sender's
fault: the caller names it). A receiver that counts bytes therefore never completes a chunk
with a byte unwritten.

**Sizes are what the operation needs.** When an operation starts here, :meth:`Mailbox.expect`
registers what this node receives in it (one ``(seq, channel)``, a *lane*): every key and its
chunk's size in bytes (:class:`Receives`). From then on a frame of that lane with another key,
or of a size other than the registered one, or bytes beyond it, is a ProtocolError; frames that
came before the start are checked against the registration then.

**Frames of operations not started yet are bounded**: at most :data:`HELD_FRAMES` frames and
:data:`HELD_BYTES` bytes wait here for lanes not started (plus the frame that crossed the line:
at most one part of :data:`PART_BYTES` per member connection). Past that, :meth:`put` says the
mailbox is :attr:`~Mailbox.crowded` and the connection's reader stops reading
(:meth:`Mailbox.drained`) until a lane starts and its frames stop counting. The transport then
stops reading that socket and TCP's flow control slows the sender: a legitimate broadcast
root running operations ahead only slows down.

Why this cannot deadlock an honest session: a reader pauses only right after it stored a frame
of a lane not started here. On one connection an honest node sends every frame of operation
*k* before any frame of *k+1* (it finishes *k* -- its sends returned -- before it starts
*k+1*), and the channels of one operation start on this node without waiting for each other's
network data. So every frame this node needs before it can start the paused lane is ahead of
the paused point, on that connection or on another one whose reader is not paused for it; the
lane starts, its frames stop counting as held, and the reader resumes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from burncoll.errors import CollectiveError, ProtocolError
from burncoll.transport.wire import DataHeader, Frame

__all__ = [
    "HELD_BYTES",
    "HELD_FRAMES",
    "PART_BYTES",
    "FrameKey",
    "Lane",
    "Mailbox",
    "Receives",
    "key_of",
]

FrameKey = tuple[int, int, int, int, int]
#: ``(seq, channel)``: one channel of one operation, started by one :meth:`Mailbox.expect`.
Lane = tuple[int, int]

#: Largest payload of one frame; bigger chunks travel in several parts.
PART_BYTES = 4 << 20
#: Most frames held for lanes this node has not started.
HELD_FRAMES = 1024
#: Most payload bytes held for lanes this node has not started (plus one part per connection).
HELD_BYTES = 64 << 20


def key_of(h: DataHeader) -> FrameKey:
    return (h.seq, h.channel, h.round, h.src, h.chunk)


def _part(h: DataHeader) -> str:
    return (f"the part at byte {h.offset} of chunk {h.chunk} of operation #{h.seq} "
            f"(round {h.round + 1})")


def _derived_elsewhere(h: DataHeader) -> int:
    raise ProtocolError(f"sent {_part(h)}, a chunk of unknown size")


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


class _Stream:
    """What arrived of one key: its chunk's size and the bytes received in order."""

    __slots__ = ("complete", "received", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.received = 0
        self.complete = False


class Mailbox:
    """Frames of one session, and the failure that ends it."""

    def __init__(self, describe: Callable[[int], str] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: The time, in seconds, that deadlines are on (the node's ``time.monotonic``): the
        #: mailbox reads no clock of its own, so a test can drive it with a fake one.
        self.clock = clock
        self._frames: dict[FrameKey, deque[Frame]] = {}
        self._waiters: dict[FrameKey, asyncio.Future[None]] = {}
        self._error: BaseException | None = None
        #: Checks a frame against the receiver's own call of ``seq``; returns an error or None.
        self._checks: dict[int, Callable[[DataHeader], CollectiveError | None]] = {}
        #: Called with a mismatch found while checking frames (the data service fails the
        #: whole session with it); defaults to failing only this mailbox.
        self.on_error: Callable[[BaseException], None] = self.fail
        #: Names a node in errors (the data service's table).
        self.describe: Callable[[int], str] = describe or (lambda node: f"node {node}")
        #: The latest operation this node started (``expect``), and when (on :attr:`clock`);
        #: -1 before the first.
        self.current = -1
        self.current_started = 0.0
        #: How many channels of each operation are running here (``expect`` minus ``done``).
        self._active: dict[int, int] = {}
        #: Memory a receiver has made ready for a part not yet arrived: ``(key, offset)`` ->
        #: the part's final place (the transport may read the payload straight into it).
        self._places: dict[tuple[FrameKey, int], memoryview] = {}
        #: Progress of every key of the lanes not left behind.
        self._streams: dict[FrameKey, _Stream] = {}
        #: The lanes started here (not yet left behind), and what each receives.
        self._started: dict[Lane, Receives] = {}
        #: Frames and payload bytes held per lane not started, and in total.
        self._held: dict[Lane, list[int]] = {}
        self._held_frames = 0
        self._held_bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    # -- placement ----------------------------------------------------------------------------
    def offer_place(self, key: FrameKey, offset: int, memory: memoryview) -> None:
        """The part ``(key, offset)`` may be received straight into ``memory``."""
        self._places[(key, offset)] = memory

    def withdraw_place(self, key: FrameKey, offset: int) -> None:
        """Withdraw the place offered for ``(key, offset)`` if it was not used."""
        self._places.pop((key, offset), None)

    def take_place(self, key: FrameKey, offset: int, size: int) -> memoryview | None:
        """Where the arriving part ``(key, offset)`` of ``size`` bytes goes, if its receiver
        offered a place for it (given out once)."""
        memory = self._places.get((key, offset))
        if memory is None or len(memory) != size or self._error is not None:
            return None
        del self._places[(key, offset)]
        return memory

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- operations ---------------------------------------------------------------------------
    def expect(self, check: Callable[[DataHeader], CollectiveError | None],
               receives: Receives) -> None:
        """Start lane ``(receives.seq, receives.channel)``: from now on its frames are checked
        against ``check`` (the fingerprint) and ``receives`` (keys and sizes); the frames
        already here are checked now, and stop counting against the held budget.

        Starting ``seq`` means every earlier operation is over on this node: what is left of
        them is forgotten, and their frames are refused from now on. A frame found wrong here
        fails the session (``on_error``), naming its sender.
        """
        seq, lane = receives.seq, (receives.seq, receives.channel)
        if seq > self.current:
            self.current, self.current_started = seq, self.clock()
            self._forget_before(seq)
        self._active[seq] = self._active.get(seq, 0) + 1
        self._checks[seq] = check
        if lane in self._started:  # pragma: no cover - one expect per lane
            return
        self._started[lane] = receives
        self._release(lane)
        keys = [k for k in self._frames if (k[0], k[1]) == lane]
        for key in keys:  # held frames were only checked for order: check them in full now
            self._streams.pop(key, None)
            for frame in self._frames[key]:
                header = frame.header
                assert header is not None  # the mailbox holds DATA frames only
                self._check(frame)
                if self._error is not None:
                    return
                try:
                    self._accept(header, len(frame.payload), receives)
                except ProtocolError as exc:
                    self.on_error(ProtocolError(
                        f"{self.describe(header.src)} {exc}; the connection between members "
                        "is corrupted, so the operation cannot be trusted"))
                    return

    def _forget_before(self, seq: int) -> None:
        """Every operation before ``seq`` is over here: drop what is left of it."""
        for lane in [lane for lane in self._held if lane[0] < seq]:
            self._release(lane)
        for lane in [lane for lane in self._started if lane[0] < seq]:
            del self._started[lane]
        for key in [k for k in self._streams if k[0] < seq]:
            del self._streams[key]
        for key in [k for k in self._frames if k[0] < seq]:  # frames no lane took
            del self._frames[key]

    def _release(self, lane: Lane) -> None:
        """The frames of ``lane`` stop counting against the held budget."""
        held = self._held.pop(lane, None)
        if held is not None:
            self._held_frames -= held[0]
            self._held_bytes -= held[1]
            if not self.crowded:
                self._room.set()

    @property
    def running(self) -> bool:
        """Whether operation ``current`` is still running here."""
        return self._active.get(self.current, 0) > 0

    def done(self, seq: int) -> None:
        """One channel of operation ``seq`` is over on this node (``expect`` was called once
        per channel; the operation is over when every channel is)."""
        left = self._active.get(seq, 1) - 1
        if left > 0:
            self._active[seq] = left
            return
        self._active.pop(seq, None)
        self._checks.pop(seq, None)
        for stale in [k for k in self._places if k[0][0] <= seq]:
            del self._places[stale]

    def _check(self, frame: Frame) -> None:
        header = frame.header
        if header is None:
            return
        check = self._checks.get(header.seq)
        if check is not None:
            error = check(header)
            if error is not None:
                self.on_error(error)

    # -- the held budget ----------------------------------------------------------------------
    @property
    def crowded(self) -> bool:
        """Whether the frames held for lanes not started have reached the budget."""
        return self._held_frames >= HELD_FRAMES or self._held_bytes >= HELD_BYTES

    @property
    def held(self) -> tuple[int, int]:
        """Frames and payload bytes held for lanes not started."""
        return self._held_frames, self._held_bytes

    async def drained(self) -> None:
        """Return once the held frames are below the budget (or the session failed)."""
        while self.crowded and self._error is None:
            self._room.clear()
            await self._room.wait()

    # -- frames -------------------------------------------------------------------------------
    def put(self, frame: Frame) -> bool:
        """Store a DATA frame and wake whoever waits for its key; ``True`` if it is held for a
        lane not started (its reader then checks :attr:`crowded`).

        Raises :class:`~burncoll.ProtocolError` for a part off its chunk's schedule (see the
        module docstring), a key or size the started lane does not receive, or a part of an
        operation this node has left behind (the sender's fault: the caller names it).
        """
        header = frame.header
        if header is None or self._error is not None:
            return False
        if header.seq < self.current:
            raise ProtocolError(
                f"sent {_part(header)} after that operation was over here (this node is at "
                f"#{self.current}): a duplicated or stray frame"
            )
        self._check(frame)  # a call with other arguments is a MismatchError, named first
        if self._error is not None:
            return False
        lane = (header.seq, header.channel)
        receives = self._started.get(lane)
        size = len(frame.payload)
        self._accept(header, size, receives)
        key = key_of(header)
        self._frames.setdefault(key, deque()).append(frame)
        if receives is None:
            held = self._held.setdefault(lane, [0, 0])
            held[0] += 1
            held[1] += size
            self._held_frames += 1
            self._held_bytes += size
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return receives is None

    def _accept(self, h: DataHeader, size: int, receives: Receives | None) -> None:
        """Advance the key of ``h`` by its part of ``size`` bytes, or raise ProtocolError.

        ``receives``: the started lane's registration (every check); ``None`` for a lane not
        started: the part is checked for order and an upper bound on its size only (the exact
        checks run when the lane starts).
        """
        key = key_of(h)
        stream = self._streams.get(key)
        if stream is None:
            if receives is None:
                total = h.chunk_bytes
            elif key not in receives.totals:
                raise ProtocolError(
                    f"sent {_part(h)}, which this node does not receive in that operation "
                    "(no such round, sender or chunk in its schedule)")
            else:
                registered = receives.totals[key]
                total = receives.size_of(h) if registered is None else registered
            if h.chunk_bytes != total:
                raise ProtocolError(
                    f"sent {_part(h)} announcing a chunk of {h.chunk_bytes} bytes where this "
                    f"node expects {total}")
            stream = _Stream(total)
            self._streams[key] = stream
        elif h.chunk_bytes != stream.total:
            raise ProtocolError(
                f"sent {_part(h)} announcing a chunk of {h.chunk_bytes} bytes after parts of "
                f"a chunk of {stream.total}")
        if stream.complete or h.offset < stream.received:
            raise ProtocolError(
                f"sent {_part(h)} twice, or bytes overlapping a part already received (byte "
                f"{stream.received} of {stream.total} comes next)")
        if h.offset > stream.received:
            raise ProtocolError(
                f"sent {_part(h)} out of order: byte {stream.received} comes next (the parts "
                "of a chunk follow each other, without gaps)")
        part = receives.part_bytes if receives is not None else PART_BYTES
        want = min(part, stream.total - h.offset)
        fits = size == want if receives is not None else (
            size <= want and (size > 0 or want == 0))
        if not fits:
            raise ProtocolError(
                f"sent {_part(h)} of {size} bytes where the schedule has {want}")
        stream.received += size
        stream.complete = stream.received >= stream.total

    async def get(self, key: FrameKey, deadline: float, on_timeout: Callable[[], BaseException]
                  ) -> Frame:
        """The next frame for ``key``; raises the session's failure, or ``on_timeout()`` once
        ``deadline`` (on :attr:`clock`) has passed."""
        while True:
            if self._error is not None:
                raise self._error
            frames = self._frames.get(key)
            if frames:
                frame = frames.popleft()
                if not frames:
                    del self._frames[key]
                return frame
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise on_timeout()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[key] = waiter
            try:
                async with asyncio.timeout(remaining):
                    await waiter
            except TimeoutError:
                self._waiters.pop(key, None)

    def fail(self, error: BaseException) -> None:
        """End the session: every current and future :meth:`get` raises ``error``."""
        if self._error is not None:
            return
        self._error = error
        self._frames.clear()
        self._places.clear()
        self._streams.clear()
        self._held.clear()
        self._held_frames = self._held_bytes = 0
        self._room.set()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
