"""The held budget: how much a node keeps of what other nodes sent before it was asked for.

The :class:`~burncoll.node.mailbox.Mailbox` (frames of operations not started here) and the
:class:`~burncoll.node.inbox.Inbox` (messages no ``recv`` took) count what they hold against
their data service's one :class:`HeldBudget`: :data:`HELD_ITEMS` items (a frame, a whole
message) and :data:`HELD_BYTES` payload bytes, together. (Arrays between the threads of one
process, :class:`~burncoll.local.post.PostOffice`, come from no other node: no budget.)

**Backpressure, not refusal**: past the budget, the reader that stored a held item pauses
(:meth:`HeldBudget.drained`) and the transport's flow control slows the sender. It resumes
once there is room or *its own item* is no longer held (its operation started, a recv took
its message, the session failed): a node holds at most the budget plus one item per member
connection, and a reader never waits on another kind of holding (frames a broadcast root ran
ahead with never stop the messages a ``recv`` here waits for). Counts change on the event
loop's thread and on a calling thread that starts its own exchange
(:meth:`~burncoll.node.mailbox.Mailbox.skip`): they are locked, and a paused reader
is woken through its loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["HELD_BYTES", "HELD_ITEMS", "HeldBudget"]

#: Most items (frames of operations not started, messages not received) held at once.
HELD_ITEMS = 4096
#: Most payload bytes held at once (plus one item per member connection).
HELD_BYTES = 64 << 20


class HeldBudget:
    """Items and payload bytes held for a data service, and the readers paused on them."""

    def __init__(self, items: int = HELD_ITEMS, nbytes: int = HELD_BYTES) -> None:
        #: The limits (a test may lower them).
        self.items, self.bytes = items, nbytes
        self._items = self._bytes = 0
        self._lock = threading.Lock()
        self._room = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the paused readers' loop
        self._paused = 0  # readers in drained

    @property
    def held(self) -> tuple[int, int]:
        """Items and payload bytes held now."""
        return self._items, self._bytes

    @property
    def crowded(self) -> bool:
        """Whether what is held has reached the budget."""
        return self._items >= self.items or self._bytes >= self.bytes

    def hold(self, items: int, nbytes: int) -> None:
        """Count ``items`` more items of ``nbytes`` payload bytes as held."""
        with self._lock:
            self._items += items
            self._bytes += nbytes

    def release(self, items: int, nbytes: int) -> None:
        """``items`` items of ``nbytes`` bytes are no longer held: wake the paused readers,
        each of which looks whether it may go on."""
        with self._lock:
            self._items -= items
            self._bytes -= nbytes
        loop = self._loop  # (a reader counted in _paused after this looks at the new counts)
        if self._paused and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._room.set)

    async def drained(self, still_held: Callable[[], bool]) -> None:
        """Return once the budget has room, or ``still_held()`` (whether the item this
        reader stored is held yet) is false."""
        self._loop = asyncio.get_running_loop()
        self._paused += 1
        try:
            while self.crowded and still_held():
                self._room.clear()
                await self._room.wait()
        finally:
            self._paused -= 1
