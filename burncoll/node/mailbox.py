"""Where received DATA frames wait until the operation they belong to asks for them.

Frames are keyed by ``(seq, channel, round, src, chunk)``: a node can receive parts of a later
operation before it starts it (a faster neighbour), and those wait here. Every wait has a
deadline; a failure wakes every waiter with the error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from burncoll.errors import CollectiveError
from burncoll.transport.wire import DataHeader, Frame

__all__ = ["FrameKey", "Mailbox", "key_of"]

FrameKey = tuple[int, int, int, int, int]


def key_of(h: DataHeader) -> FrameKey:
    return (h.seq, h.channel, h.round, h.src, h.chunk)


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

    @property
    def error(self) -> BaseException | None:
        return self._error

    def expect(self, seq: int, check: Callable[[DataHeader], CollectiveError | None]) -> None:
        """Start checking frames of ``seq``; frames already here are checked now."""
        self._checks[seq] = check
        queued = [f for key, frames in self._frames.items() if key[0] == seq for f in frames]
        for frame in queued:
            self._check(frame)

    def done(self, seq: int) -> None:
        """Operation ``seq`` is over on this node."""
        self._checks.pop(seq, None)

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
        """Store a DATA frame and wake whoever waits for its key."""
        header = frame.header
        if header is None or self._error is not None:
            return
        key = key_of(header)
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
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
