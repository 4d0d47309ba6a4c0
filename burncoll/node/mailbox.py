"""Where received DATA frames wait until the operation they belong to asks for them.

Frames are keyed by ``(seq, channel, round, src, chunk)``: a node can receive parts of a later
operation before it starts it (a faster neighbour), and those wait here. Every wait has a
deadline; a failure wakes every waiter with the error.

Every part of every chunk is expected exactly once, during its operation: the receiver counts
bytes to know when a chunk is whole, so a part received twice would complete a chunk with
another part missing -- a silently wrong result. :meth:`Mailbox.put` therefore refuses a part
it has already seen, and a part of an operation this node has already left behind (it started
a later one), with a :class:`~burncoll.ProtocolError`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from burncoll.errors import CollectiveError, ProtocolError
from burncoll.transport.wire import DataHeader, Frame

__all__ = ["FrameKey", "Mailbox", "key_of"]

FrameKey = tuple[int, int, int, int, int]


def key_of(h: DataHeader) -> FrameKey:
    return (h.seq, h.channel, h.round, h.src, h.chunk)


def _part(h: DataHeader) -> str:
    return (f"the part at byte {h.offset} of chunk {h.chunk} of operation #{h.seq} "
            f"(round {h.round + 1})")


class Mailbox:
    """Frames of one session, and the failure that ends it."""

    def __init__(self) -> None:
        self._frames: dict[FrameKey, deque[Frame]] = {}
        self._waiters: dict[FrameKey, asyncio.Future[None]] = {}
        self._error: BaseException | None = None
        #: Checks a frame against the receiver's own call of ``seq``; returns an error or None.
        self._checks: dict[int, Callable[[DataHeader], CollectiveError | None]] = {}
        #: Called with a mismatch found while checking frames (the data service fails the
        #: whole session with it); defaults to failing only this mailbox.
        self.on_error: Callable[[BaseException], None] = self.fail
        #: The parts ``(key, offset)`` received of each operation not yet left behind.
        self._seen: dict[int, set[tuple[FrameKey, int]]] = {}
        #: The latest operation this node started (``expect``), and when; -1 before the first.
        self.current = -1
        self.current_started = 0.0
        #: How many channels of each operation are running here (``expect`` minus ``done``).
        self._active: dict[int, int] = {}
        #: Memory a receiver has made ready for a part not yet arrived: ``(key, offset)`` ->
        #: the part's final place (the transport may read the payload straight into it).
        self._landing: dict[tuple[FrameKey, int], memoryview] = {}

    def land(self, key: FrameKey, offset: int, memory: memoryview) -> None:
        """The part ``(key, offset)`` may be received straight into ``memory``."""
        self._landing[(key, offset)] = memory

    def unland(self, key: FrameKey, offset: int) -> None:
        self._landing.pop((key, offset), None)

    def landing(self, key: FrameKey, offset: int, size: int) -> memoryview | None:
        """Where the arriving part ``(key, offset)`` of ``size`` bytes goes, if its receiver
        made room for it (given out once)."""
        memory = self._landing.get((key, offset))
        if memory is None or len(memory) != size or self._error is not None:
            return None
        del self._landing[(key, offset)]
        return memory

    @property
    def error(self) -> BaseException | None:
        return self._error

    def expect(self, seq: int, check: Callable[[DataHeader], CollectiveError | None]) -> None:
        """Start checking frames of ``seq``; frames already here are checked now.

        Starting ``seq`` means every earlier operation is over on this node: what is left of
        them is forgotten, and their frames are refused from now on.
        """
        if seq > self.current:
            self.current, self.current_started = seq, time.monotonic()
            for old in [s for s in self._seen if s < seq]:
                del self._seen[old]
            for key in [k for k in self._frames if k[0] < seq]:  # pragma: no cover - defensive
                del self._frames[key]
        self._active[seq] = self._active.get(seq, 0) + 1
        self._checks[seq] = check
        queued = [f for key, frames in self._frames.items() if key[0] == seq for f in frames]
        for frame in queued:
            self._check(frame)

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
        for stale in [k for k in self._landing if k[0][0] <= seq]:
            del self._landing[stale]

    def _check(self, frame: Frame) -> None:
        header = frame.header
        if header is None:
            return
        check = self._checks.get(header.seq)
        if check is not None:
            error = check(header)
            if error is not None:
                self.on_error(error)

    def put(self, frame: Frame) -> None:
        """Store a DATA frame and wake whoever waits for its key.

        Raises :class:`~burncoll.ProtocolError` for a part received twice, or one of an
        operation this node has left behind (the sender's fault: the caller names it).
        """
        header = frame.header
        if header is None or self._error is not None:
            return
        key = key_of(header)
        if header.seq < self.current:
            raise ProtocolError(
                f"sent {_part(header)} after that operation was over here (this node is at "
                f"#{self.current}): a duplicated or stray frame"
            )
        seen = self._seen.setdefault(header.seq, set())
        if (key, header.offset) in seen:
            raise ProtocolError(f"sent {_part(header)} twice")
        seen.add((key, header.offset))
        self._frames.setdefault(key, deque()).append(frame)
        self._check(frame)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, key: FrameKey, deadline: float, on_timeout: Callable[[], BaseException]
                  ) -> Frame:
        """The next frame for ``key``; raises the session's failure, or ``on_timeout()``."""
        while True:
            if self._error is not None:
                raise self._error
            frames = self._frames.get(key)
            if frames:
                frame = frames.popleft()
                if not frames:
                    del self._frames[key]
                return frame
            remaining = deadline - time.monotonic()
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
        self._landing.clear()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
