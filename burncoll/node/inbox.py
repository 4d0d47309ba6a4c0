"""Point-to-point messages from other nodes: assembled from their parts, checked, held until a
recv takes them (bounded), and waited for (docs/architecture.md, "Point-to-point").

A message arrives as DATA frames of op kind :attr:`~burncoll.ops.OpKind.P2P`, outside the
collectives' mailbox. Its header says: ``seq`` -- the message's number per key ``(src rank, dst
rank, tag)``, from 0; ``root`` -- the dst rank; ``chunk`` -- the src rank; ``channel`` -- the
tag; ``round`` 0; dtype, shape, the part's ``offset`` and the message's size ``chunk_bytes``.
Parts of at most :data:`~burncoll.node.mailbox.PART_BYTES` come in order, one message at a
time per connection. :meth:`Inbox.put` checks every frame before anything is allocated (a
:class:`~burncoll.ProtocolError` names the sender otherwise); held messages count against the
data service's :class:`~burncoll.node.held.HeldBudget` (:meth:`Inbox.holds`). A recv
(:meth:`Inbox.take`) gets its key's messages in order, waiters in the order they started.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from burncoll.dtypes import dtype_from_name
from burncoll.errors import ProtocolError
from burncoll.levels import HostArray
from burncoll.node.held import HeldBudget
from burncoll.node.mailbox import PART_BYTES
from burncoll.protocol.checks import array_bytes, memory_bytes
from burncoll.protocol.wire import DataHeader, Frame

__all__ = ["Inbox", "Message", "P2PKey", "memory_bytes"]

#: ``(src rank, dst rank, tag)``: messages of one key arrive, and are taken, in order.
P2PKey = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Message:
    """One whole message: its key, number, dtype, shape and bytes (a new, writable buffer)."""

    key: P2PKey
    seq: int
    dtype: str
    shape: tuple[int, ...]
    data: HostArray

    def array(self) -> HostArray:
        """The message as an array of its dtype and shape (a view of :attr:`data`)."""
        return self.data.view(dtype_from_name(self.dtype)).reshape(self.shape)


class _Assembly:
    """A message whose parts are arriving: what it is and how many bytes came."""

    __slots__ = ("message", "received")

    def __init__(self, message: Message) -> None:
        self.message = message
        self.received = 0


def _part(h: DataHeader) -> str:
    return (f"the part at byte {h.offset} of point-to-point message #{h.seq} from rank "
            f"{h.chunk} to rank {h.root} (tag {h.channel})")


class Inbox:
    """The point-to-point messages this node receives (on the node's event loop)."""

    def __init__(self, *, part_bytes: int = PART_BYTES, memory: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 budget: HeldBudget | None = None) -> None:
        self.part_bytes = part_bytes
        #: The most bytes one message may have (this machine's memory).
        self.memory = memory_bytes() if memory is None else memory
        self.clock = clock
        self._me = -1
        self._rank_nodes: tuple[int, ...] = ()
        self._next: dict[P2PKey, int] = {}
        self._assembling: dict[int, _Assembly] = {}
        self._ready: dict[P2PKey, deque[Message]] = {}
        self._waiters: dict[P2PKey, deque[asyncio.Future[Message]]] = {}
        #: What messages not received count against (shared with the mailbox).
        self.budget = budget or HeldBudget()
        self._error: BaseException | None = None

    def join(self, node_index: int, rank_nodes: Sequence[int]) -> None:
        """This node's index, and the node of every rank (the session's table)."""
        self._me = node_index
        self._rank_nodes = tuple(rank_nodes)

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- receiving ----------------------------------------------------------------------------
    def put(self, frame: Frame, node: int) -> bool:
        """Take a P2P DATA frame from ``node``; ``True`` when it completed a message that no
        recv waited for, so it is held (the reader then minds the :attr:`budget`). Raises
        :class:`~burncoll.ProtocolError` (worded "sent ...") for a frame that breaks the rules
        of the module docstring."""
        h = frame.header
        if h is None or self._error is not None:
            return False
        size = len(frame.payload)
        assembly = self._assembling.get(node)
        if assembly is None:
            assembly = self._start(h, node, size)
            self._assembling[node] = assembly
        else:
            self._continue(assembly, h, size)
        data = assembly.message.data
        if size:
            data[assembly.received:assembly.received + size] = np.frombuffer(
                frame.payload, np.uint8)
        assembly.received += size
        if assembly.received < data.size:
            return False
        del self._assembling[node]
        return self._deliver(assembly.message)

    def _start(self, h: DataHeader, node: int, size: int) -> _Assembly:
        """The first part of a message from ``node``: every check, then its buffer."""
        src, dst, tag = h.chunk, h.root, h.channel
        ranks = self._rank_nodes
        if not 0 <= src < len(ranks) or ranks[src] != node:
            raise ProtocolError(f"sent {_part(h)} in the name of rank {src}, which is not "
                                "one of its peers")
        if not 0 <= dst < len(ranks) or ranks[dst] != self._me:
            raise ProtocolError(f"sent {_part(h)} for rank {dst}, which is not a peer of "
                                "this node")
        if h.round != 0 or h.reduce_op is not None:
            raise ProtocolError(f"sent {_part(h)} with round {h.round + 1} or a reduce op: "
                                "a point-to-point message has neither")
        key = (src, dst, tag)
        expected = self._next.get(key, 0)
        if h.seq != expected:
            raise ProtocolError(f"sent {_part(h)} where message #{expected} of that rank and "
                                "tag comes next: a message lost, repeated or out of order")
        if h.offset != 0:
            raise ProtocolError(f"sent {_part(h)} as the start of a message: a message starts "
                                "at byte 0")
        total = self._size(h)
        if size != min(self.part_bytes, total):
            raise ProtocolError(f"sent {_part(h)} of {size} bytes where the message's first "
                                f"part has {min(self.part_bytes, total)}")
        assert h.dtype is not None  # checked by _size
        try:
            data = np.empty(total, np.uint8)
        except MemoryError as exc:
            raise ProtocolError(f"sent {_part(h)} of a message of {total} bytes, which this "
                                f"node cannot allocate now ({exc})") from exc
        self._next[key] = expected + 1
        return _Assembly(Message(key, h.seq, h.dtype, tuple(h.shape), data))

    def _size(self, h: DataHeader) -> int:
        """The message's size in bytes, from its dtype and shape, if it may be received."""
        if h.dtype is None:
            raise ProtocolError(f"sent {_part(h)} without a dtype")
        total = array_bytes(h, _part(h))
        if h.chunk_bytes != total:
            raise ProtocolError(f"sent {_part(h)} announcing {h.chunk_bytes} bytes for an "
                                f"array {h.dtype}{list(h.shape)} of {total}")
        if total > self.memory:
            raise ProtocolError(f"sent {_part(h)} of an array {h.dtype}{list(h.shape)} of "
                                f"{total} bytes, more than this machine's memory "
                                f"({self.memory} bytes)")
        return total

    def _continue(self, assembly: _Assembly, h: DataHeader, size: int) -> None:
        """A next part from the node whose message ``assembly`` is arriving."""
        m, got = assembly.message, assembly.received
        if (h.chunk, h.root, h.channel) != m.key or h.seq != m.seq:
            raise ProtocolError(
                f"sent {_part(h)} before the rest of message #{m.seq} from rank {m.key[0]} "
                f"to rank {m.key[1]} (tag {m.key[2]}): the parts of a message follow each "
                "other")
        if (h.dtype, tuple(h.shape), h.chunk_bytes, h.round, h.reduce_op) != (
                m.dtype, m.shape, m.data.size, 0, None):
            raise ProtocolError(f"sent {_part(h)} with another header than the message's "
                                f"first part ({m.dtype}{list(m.shape)}, {m.data.size} bytes)")
        if h.offset != got:
            raise ProtocolError(f"sent {_part(h)} out of order: byte {got} comes next (the "
                                "parts of a message follow each other, without gaps)")
        want = min(self.part_bytes, m.data.size - got)
        if size != want:
            raise ProtocolError(f"sent {_part(h)} of {size} bytes where the message has {want}")

    def _deliver(self, message: Message) -> bool:
        """A whole message: to the receive waiting longest for its key, or held (``True``)."""
        key = message.key
        waiters = self._waiters.get(key)
        held = False
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(message)
                break
        else:
            self._ready.setdefault(key, deque()).append(message)
            self.budget.hold(1, message.data.nbytes)
            held = True
        if waiters is not None and not waiters:
            del self._waiters[key]
        return held

    def holds(self, header: DataHeader) -> bool:
        """Whether the message ``header`` belongs to is held, no recv having taken it."""
        ready = self._ready.get((header.chunk, header.root, header.channel))
        return ready is not None and ready[0].seq <= header.seq

    # -- taking -------------------------------------------------------------------------------
    async def take(self, key: P2PKey, deadline: float,
                   on_timeout: Callable[[], BaseException]) -> Message:
        """The next message of ``key``; raises the session's failure, or ``on_timeout()`` once
        ``deadline`` (on :attr:`clock`) has passed."""
        if self._error is not None:
            raise self._error
        ready = self._ready.get(key)
        if ready:
            message = ready.popleft()
            if not ready:
                del self._ready[key]
            self.budget.release(1, message.data.nbytes)
            return message
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise on_timeout()
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, deque()).append(waiter)
        try:  # (asyncio.wait leaves the waiter alone: a message handed over is never lost)
            await asyncio.wait([waiter], timeout=remaining)
        finally:
            if not waiter.done():
                waiter.cancel()
                self._forget(key, waiter)
        if waiter.cancelled():
            raise on_timeout()
        return waiter.result()

    def _forget(self, key: P2PKey, waiter: asyncio.Future[Message]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]

    def fail(self, error: BaseException) -> None:
        """End the session: every current and future :meth:`take` raises ``error``."""
        if self._error is not None:
            return
        self._error = error
        held = [m.data.nbytes for ready in self._ready.values() for m in ready]
        self._ready.clear()
        self._assembling.clear()
        self.budget.release(len(held), sum(held))
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
        self._waiters.clear()
