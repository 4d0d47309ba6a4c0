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
registers what this node receives in it (one ``(seq, channel)``, an *op channel*): every key and its
chunk's size in bytes (:class:`Receives`). From then on a frame of that op channel with another key,
or of a size other than the registered one, or bytes beyond it, is a ProtocolError; frames that
came before the start are checked against the registration then.

**Frames of operations not started yet are bounded**: they count against the data service's
:class:`~burncoll.node.held.HeldBudget` (one frame is one item) until their op channel starts. Past
the budget, the reader that stored such a frame stops reading until there is room or that
frame's op channel starts (:meth:`Mailbox.holds`); the transport then stops reading that socket and
TCP's flow control slows the sender: a legitimate broadcast root running operations ahead
only slows down.

Why this cannot deadlock an honest session: a reader pauses only right after it stored a frame
of an op channel not started here. On one connection an honest node sends every frame of operation
*k* before any frame of *k+1* (it finishes *k* -- its sends returned -- before it starts
*k+1*), and the channels of one operation start on this node without waiting for each other's
network data. So every frame this node needs before it can start the paused op channel is ahead of
the paused point, on that connection or on another one whose reader is not paused for it; the
op channel starts, its frames stop counting as held, and the reader resumes.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

from burncoll.errors import CollectiveError, ProtocolError
from burncoll.node.held import HeldBudget
from burncoll.node.places import Place, settled
from burncoll.node.receives import (
    PART_BYTES,
    FrameKey,
    OpChannel,
    Receives,
    Stream,
    accept_part,
    key_of,
)
from burncoll.node.receives import describe_part as _part
from burncoll.protocol.wire import DataHeader, Frame

__all__ = [
    "NOTHING",
    "PART_BYTES",
    "FrameKey",
    "OpChannel",
    "Mailbox",
    "Receives",
    "key_of",
]

#: What an op channel receives on the member connections when it runs elsewhere
#: (:meth:`Mailbox.skip`): nothing, so that every frame of it arriving there is a ProtocolError.
NOTHING = Receives(-1, 0, {})

#: Checks a frame's header against this node's own call: an error, or ``None``.
_Check = Callable[[DataHeader], CollectiveError | None]


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run ``method`` under the mailbox's lock: the event loop's thread stores frames while
    a calling thread may start or end its exchange (:meth:`Mailbox.skip`)."""
    @functools.wraps(method)
    def locked(self: Mailbox, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(F, locked)


class Mailbox:
    """Frames of one session, and the failure that ends it."""

    def __init__(self, describe: Callable[[int], str] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 budget: HeldBudget | None = None) -> None:
        #: The time, in seconds, that deadlines are on (the node's ``time.monotonic``): the
        #: mailbox reads no clock of its own, so a test can drive it with a fake one.
        self.clock = clock
        self._frames: dict[FrameKey, deque[Frame]] = {}
        self._waiters: dict[FrameKey, asyncio.Future[None]] = {}
        self._error: BaseException | None = None
        #: Checks a frame against the receiver's own call of ``seq``; returns an error or None.
        self._checks: dict[int, _Check] = {}
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
        #: Where a receiver wants a part not yet arrived: ``(key, offset)`` -> memory the
        #: transport may read the payload straight into, or a reduction (node.places).
        self._places: dict[tuple[FrameKey, int], Place] = {}
        #: Progress of every key of the op channels not left behind.
        self._streams: dict[FrameKey, Stream] = {}
        #: The op channels started here (not yet left behind), and what each receives.
        self._started: dict[OpChannel, Receives] = {}
        #: The operation whose channel 0 was started last by :meth:`skip`.
        self._skipped = -1
        #: What frames of op channels not started count against (shared with the inbox).
        self.budget = budget or HeldBudget()
        #: Frames and payload bytes held per op channel not started.
        self._held: dict[OpChannel, list[int]] = {}
        #: Held while the structures above change (a re-entrant lock: a failure found while
        #: storing a frame fails the mailbox from inside ``put``).
        self._lock = threading.RLock()

    # -- placement ----------------------------------------------------------------------------
    @_locked
    def offer_place(self, key: FrameKey, offset: int, place: Place) -> None:
        """The part ``(key, offset)`` may be received straight into ``place``."""
        self._places[(key, offset)] = place

    @_locked
    def withdraw_place(self, key: FrameKey, offset: int) -> None:
        """Withdraw the place offered for ``(key, offset)`` if it was not used."""
        self._places.pop((key, offset), None)

    @_locked
    def take_place(self, key: FrameKey, offset: int, size: int) -> memoryview | None:
        """Where the arriving part ``(key, offset)`` of ``size`` bytes goes, if its receiver
        offered a place for it (given out once)."""
        memory = self._places.get((key, offset))
        if not isinstance(memory, memoryview) or len(memory) != size or self._error is not None:
            return None
        del self._places[(key, offset)]
        return memory

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- operations ---------------------------------------------------------------------------
    @_locked
    def expect(self, check: _Check, receives: Receives) -> None:
        """Start op channel ``(receives.seq, receives.channel)``: from now on its frames are checked
        against ``check`` (the fingerprint) and ``receives`` (keys and sizes); the frames
        already here are checked now, and stop counting against the held budget. Starting
        ``seq`` means every earlier operation is over on this node: what is left of them is
        forgotten, and their frames are refused from now on. A frame found wrong here fails
        the session (``on_error``), naming its sender."""
        self._expect(check, receives)

    def _expect(self, check: _Check, receives: Receives) -> None:
        seq, op_channel = receives.seq, (receives.seq, receives.channel)
        if seq > self.current:
            self.current, self.current_started = seq, self.clock()
            self._forget_before(seq)
        self._active[seq] = self._active.get(seq, 0) + 1
        self._checks[seq] = check
        if op_channel in self._started:  # pragma: no cover - one expect per op channel
            return
        self._started[op_channel] = receives
        if self._held:
            self._release(op_channel)
        keys = [k for k in self._frames if (k[0], k[1]) == op_channel] if self._frames else ()
        for key in keys:  # held frames were only checked for order: check them in full now
            self._streams.pop(key, None)
            for frame in self._frames[key]:
                header = frame.header
                assert header is not None  # the mailbox holds DATA frames only
                self._check(frame)
                if self._error is not None:
                    return
                try:
                    accept_part(self._streams, header, len(frame.payload), receives)
                except ProtocolError as exc:
                    self.on_error(ProtocolError(
                        f"{self.describe(header.src)} {exc}; the connection between members "
                        "is corrupted, so the operation cannot be trusted"))
                    return

    def _forget_before(self, seq: int) -> None:
        """Every operation before ``seq`` is over here: drop what is left of it."""
        for old in [k for k in self._held if k[0] < seq] if self._held else ():
            self._release(old)
        tables: tuple[dict[Any, Any], ...] = (self._started, self._streams, self._frames)
        for table in tables:  # (the frames no op channel took)
            for key in [k for k in table if k[0] < seq] if table else ():
                del table[key]

    def _release(self, op_channel: OpChannel) -> None:
        """The frames of ``op_channel`` stop counting against the held budget."""
        held = self._held.pop(op_channel, None)
        if held is not None:
            self.budget.release(*held)

    def holds(self, header: DataHeader) -> bool:
        """Whether frames of ``header``'s op channel are held (its op channel not started yet)."""
        return (header.seq, header.channel) in self._held

    @property
    def running(self) -> bool:
        """Whether operation ``current`` is still running here."""
        return self._active.get(self.current, 0) > 0

    def done(self, seq: int) -> None:
        """One channel of operation ``seq`` is over on this node (``expect`` was called once
        per channel; the operation is over when every channel is)."""
        with self._lock:  # (not ``_locked``: one call fewer on every operation's path)
            left = self._active.get(seq, 1) - 1
            if left > 0:
                self._active[seq] = left
                return
            self._active.pop(seq, None)
            self._checks.pop(seq, None)
            for stale in [k for k in self._places if k[0][0] <= seq] if self._places else ():
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

    # -- frames -------------------------------------------------------------------------------
    @_locked
    def put(self, frame: Frame) -> bool:
        """Store a DATA frame and wake whoever waits for its key; ``True`` if it is held for a
        op channel not started (its reader then minds the :attr:`budget`).

        Raises :class:`~burncoll.ProtocolError` for a part off its chunk's schedule (see the
        module docstring), a key or size the started op channel does not receive, or a part of an
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
        op_channel = (header.seq, header.channel)
        receives = self._started.get(op_channel)
        if receives is None and header.seq == self._skipped and not header.channel:
            receives = NOTHING  # (refused: that operation runs on the lanes or the mail)
        size = len(frame.payload)
        accept_part(self._streams, header, size, receives)
        key = key_of(header)
        if frame.borrowed:  # lent by the transport: its own payload now, checked as it is
            frame = settled(frame, self._places.pop((key, header.offset), None))
        self._frames.setdefault(key, deque()).append(frame)
        if receives is None:
            held = self._held.setdefault(op_channel, [0, 0])
            held[0] += 1
            held[1] += size
            self.budget.hold(1, size)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return receives is None

    async def get(self, key: FrameKey, deadline: float, on_timeout: Callable[[], BaseException]
                  ) -> Frame:
        """The next frame for ``key``; raises the session's failure, or ``on_timeout()`` once
        ``deadline`` (on :attr:`clock`) has passed."""
        while True:
            if self._error is not None:
                raise self._error
            frame = self._pop(key)
            if frame is not None:
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

    @_locked
    def _pop(self, key: FrameKey) -> Frame | None:
        frames = self._frames.get(key)
        if not frames:
            return None
        frame = frames.popleft()
        if not frames:
            del self._frames[key]
        return frame

    def skip(self, seq: int, check: _Check) -> bool:
        """:meth:`expect` of channel 0 of operation ``seq`` from a calling thread, for a run
        that receives nothing on the member connections (the lanes, the host mail): a frame
        of that op channel arriving there is checked against ``check`` (a mismatch, reported), then
        refused as no part of the operation (a ProtocolError). :meth:`done` ends it.
        ``False``, with nothing done, when that needs the event loop: after a failure, or
        with frames of that op channel here already (the loop's :meth:`expect` of :data:`NOTHING`
        reports them there)."""
        with self._lock:  # (not ``_locked``: one call fewer on every operation's path)
            if self._error is not None or (self._frames and any(
                    k[0] == seq and k[1] == 0 for k in self._frames)):
                return False
            if seq > self.current:
                self.current, self.current_started = seq, self.clock()
                if self._frames or self._started or self._streams or self._held:
                    self._forget_before(seq)
            self._active[seq] = self._active.get(seq, 0) + 1
            self._checks[seq] = check
            self._skipped = seq
            return True

    @_locked
    def fail(self, error: BaseException) -> None:
        """End the session: every current and future :meth:`get` raises ``error``."""
        if self._error is not None:
            return
        self._error = error
        self._frames.clear()
        self._places.clear()
        self._streams.clear()
        for op_channel in list(self._held):
            self._release(op_channel)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
