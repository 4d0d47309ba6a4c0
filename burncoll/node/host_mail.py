"""Host mail: the one-round exchange of node processes of one host through their host memory
(:mod:`burncoll.node.host_memory`) instead of their caller sockets.

**Why.** Over a socket every small all-reduce (and barrier) wakes each process through the
kernel once per message: with 4 node processes on 2 CPUs an 8 B all-reduce took ~1 ms here,
where Open MPI's processes, polling shared memory, take ~40 us (docs/performance.md). Here a
node writes its message (the exchange's header and payload, exactly what it would send) into
its own mapping and then raises a counter there; the others, polling the counters, read it.

**Layout** (at the start of every node's mapping): a counter (the number of messages the
node has posted this session, a 64-bit word on a cache line of its own; the next word of the
line says which node's counter this node sleeps on, see below), then two slots of
:data:`SLOT_BYTES`. Message ``k`` goes into slot ``k % 2``. A node posts message ``k + 1``
only after it has read every other node's message ``k``, and every node read message
``k - 1`` (the slot's last content) before it posted ``k``: a slot is never written while a
node may still read it, with no acknowledgement but the counters.

**The gather** (``levels.HostGather``, :meth:`SharedMail.gather`): every node but the root
posts its message ``k``; the root reads them all and posts the result as ``k + 1`` (it posts
no ``k``: its counter goes from ``k - 1`` to ``k + 1``); every other node reads that and only
then posts its own ``k + 1`` (a header alone, which no one reads). A
node's ``k`` is read by the root alone, before the root posts ``k + 1``, which the node awaits
before it writes that slot again; the root's ``k + 1`` is rewritten at ``k + 3``, once every
node posted ``k + 2``, which each does only after it read it. So, with exchanges and gathers in
any order, no slot is written while a node may still read it.

**Ordering.** The writer stores the message, then the counter; a reader loads the counter,
then the message. x86-64 keeps stores in order and loads in order (its memory model), so a
reader that sees the counter sees the message. Other processors need fences that Python
cannot issue: there :data:`ORDERED_STORES` is false and the exchange stays on the sockets.

**Waiting** (:meth:`SharedMail.exchange`): a reader looks at the counters,
giving its CPU away between looks for a while (the nodes it waits for may need it), then
sleeps on the first awaited node's counter (:class:`Futex`). Linux's futex compares the
counter and sleeps in one step, so a post between the reader's look and its sleep is never
missed. A post wakes only where a sleeper is (the system call costs the poster microseconds,
and a woken process takes its CPU): a reader first writes, in its own counter line, the node
it sleeps on (its index + 1, 0 when awake), then sleeps (the kernel's futex orders that store
before it compares the counter); a poster raises its counter, passes a full barrier (a locked
instruction: an uncontended lock's acquire), then reads the other nodes' words and wakes its
counter's sleepers if one names it. Of a reader that sleeps and a poster that skips the wake,
one of the two would have seen the other's store (the two stores precede the two loads), so no
wake-up is lost; a word a node leaves set costs only a wake.

**Trust.** What a node reads is checked as a socket's message is (the header byte for byte,
:meth:`burncoll.node.lane_exchange.LaneExchange.trade`), and only as many bytes as this
node's own call gives are read; a counter another node raises too far only makes this node
read that slot early, to find a wrong header or that node's own contribution. While it waits,
a node watches the lanes (:meth:`burncoll.node.lanes.Lanes.watch`): the deadline and a failed
session (the lanes' wake-up pipe). The lanes' sockets carried only the join's host-memory
handshake and are closed once it gave every node the mail (``Lanes.drop_sockets``): a node
lost meanwhile fails the session through its member connections (a connection that breaks
without ``bye``) and the orchestrator (its connection closes), which wakes every wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from burncoll.node.lanes import Lanes, LaneTimeout, LaneWoken
from burncoll.protocol.wire import FIXED_HEADER_BYTES, MAX_NDIM
from burncoll.strategies.auto import MAIL_BYTES
from burncoll.transport.base import Buffer

__all__ = ["MAIL_AREA_BYTES", "ORDERED_STORES", "SLOT_BYTES", "Futex", "SharedMail"]

#: Whether this processor keeps a thread's stores, and its loads, in program order (x86-64,
#: and a 64-bit Python: a 32-bit one there has other system call numbers).
ORDERED_STORES = platform.machine().lower() in {"x86_64", "amd64"} and sys.maxsize > 2**32
#: Linux's futex system call on x86-64, its operations, and the most waiters one wakes.
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE, _ALL = 202, 0, 1, 2**31 - 1
#: How a futex wait ends without an error: the word had changed, the time passed, a signal.
_WAIT_ENDS = frozenset({errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR})
_LINE = 64
#: A slot's size (whole cache lines): the largest payload ``choose`` sends through the mail
#: (:data:`~burncoll.strategies.auto.MAIL_BYTES`) with the largest header.
SLOT_BYTES = -(-(MAIL_BYTES + FIXED_HEADER_BYTES + 8 * MAX_NDIM) // _LINE) * _LINE
#: The mail's size in a mapping: the counter's line and two slots.
MAIL_AREA_BYTES = _LINE + 2 * SLOT_BYTES
#: The longest sleep between looks at the mail, in seconds: a post wakes the sleeper
#: (:meth:`SharedMail.sleep`), but a failure or a closed lane is seen only when it looks.
MAIL_NAP = 2e-3


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """Sleeping on a counter until it changes, woken by its writer (Linux's futex: the
    kernel compares the word and sleeps at once, so a wake-up is never lost). Shared futexes
    key on the file and offset, so every process's mapping of a file meets on the same
    word. Off Linux on x86-64, or where the system call is refused, :meth:`wait` just
    sleeps."""

    def __init__(self) -> None:
        self._syscall: Any = None
        if sys.platform == "linux" and ORDERED_STORES:
            with contextlib.suppress(OSError, AttributeError):  # (no C library to call)
                self._syscall = ctypes.CDLL(None, use_errno=True).syscall
                self._syscall.restype = ctypes.c_long

    def wait(self, address: int, value: int, seconds: float) -> None:
        """Sleep until the 32-bit word at ``address`` is woken or no longer ``value``, or for
        ``seconds`` at most (signals end it early too)."""
        if self._syscall is None:
            time.sleep(seconds)
            return
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        if self._syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT,
                         ctypes.c_uint32(value), ctypes.byref(timeout), None, 0) == -1 and (
                ctypes.get_errno() not in _WAIT_ENDS):
            self._syscall = None  # (refused here: a filter, an emulator) sleep from now on
            time.sleep(seconds)

    def wake(self, address: int) -> None:
        """Wake every process sleeping on the word at ``address``."""
        if self._syscall is not None:
            self._syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _ALL, None, None,
                          0)


class SharedMail:
    """Every node's mail in the mappings ``maps`` (by node index, this node's
    writable), at offset ``at`` (a multiple of 64) in each."""

    def __init__(self, maps: dict[int, memoryview], me: int, at: int) -> None:
        self._maps = maps
        self._me = me
        #: Every node's counter and the word that says whom it sleeps on (see the module).
        self._counters = {n: np.frombuffer(m, np.uint64, 2, at) for n, m in maps.items()}
        #: Every counter's address in this process (its low 32 bits are the futex word).
        self._addresses = {n: int(c.ctypes.data) for n, c in self._counters.items()}
        self._futex = Futex()
        self._other_lines = tuple(c for n, c in self._counters.items() if n != me)
        #: The other nodes, whose mail this node reads.
        self.others = tuple(n for n in maps if n != me)
        #: Acquired and released after a post: its locked instruction is the barrier.
        self._barrier = threading.Lock()
        self._slots = (at + _LINE, at + _LINE + SLOT_BYTES)
        #: The number of this node's last message: its counter (the messages it posted, and
        #: the numbers it skipped as the host gather's root).
        self.posted_count = 0

    def exchange(self, lanes: Lanes, parts: Sequence[Buffer] | None, size: int,
                 deadline: float) -> dict[int, memoryview]:
        """The lanes' exchange (:meth:`~burncoll.node.lanes.Lanes.exchange`) through the
        mail: this node's message is ``parts`` one after the other (``size`` bytes), and each
        other node's is read as a view of as many bytes in its slot, by ``deadline``. The
        lanes are only watched (where they still are: see :meth:`Lanes.drop_sockets`): a lane
        that closes is the loss of its node, a message on it a mismatch. ``parts`` ``None``:
        the host gather's root, which reads every node's next message and posts nothing (its
        number: the root's result is the one after it)."""
        return lanes.alone(lambda wake: self._exchange(lanes, parts, size, deadline))

    def _exchange(self, lanes: Lanes, parts: Sequence[Buffer] | None, size: int,
                  deadline: float) -> dict[int, memoryview]:
        """(Alone on the lanes.) Post, wait for every other node's message of that number
        (:meth:`_await`), and read them all."""
        k = self.posted_count + 1 if parts is None else self.post(parts)
        self._await(lanes, list(self.others), k, deadline)
        return self.read_all(self.others, k, size)

    def gather(self, lanes: Lanes, parts: Sequence[Buffer], size: int, root: int,
               deadline: float) -> memoryview:
        """A node's half of the host gather (``levels.HostGather``) but ``root``'s: post
        ``parts`` as message ``k`` and read ``root``'s message ``k + 1`` (its result, posted
        once it read every node's ``k``), a view of ``size`` bytes, by ``deadline``; the lanes
        only watched, as in :meth:`exchange`. The caller posts ``k + 1`` once it has read it:
        its slot is then rewritten only after ``root`` read its ``k`` (see the module)."""
        def run(wake: int) -> memoryview:
            k = self.post(parts) + 1
            try:
                self._await(lanes, [root], k, deadline, yields=False)
            except LaneTimeout:  # (the root waits for them: name who has not posted)
                raise LaneTimeout(next(iter(self.missing(self.others, k - 1)), root)) from None
            return self.read(root, k, size)
        return lanes.alone(run)

    def _await(self, lanes: Lanes, waiting: list[int], k: int, deadline: float,
               yields: bool = True) -> None:
        """(Alone on the lanes.) Wait until each of ``waiting`` posted its message ``k``:
        look at their counters, giving the CPU away between looks for a while
        (:class:`~burncoll.node.spinning.Yielding`), then sleep until the first node awaited
        posts (woken by it; :data:`MAIL_NAP` at most); every 16 looks and before every sleep,
        the lanes' watch too."""
        waiting, yielding = self.missing(waiting, k), lanes.yielding
        now = time.perf_counter()
        yield_until, looks = now + (yielding.budget() if yields else 0.0), 0
        while waiting:
            looks += 1
            if now < yield_until:
                if not looks & 15:
                    lanes.watch(waiting, deadline, lambda n: self.posted(n, k))
                os.sched_yield()
                then, now = now, time.perf_counter()
                if not yielding.yielded(now - then):
                    yield_until = now
            else:
                lanes.watch(waiting, deadline, lambda n: self.posted(n, k))
                self.sleep(waiting[0], k, min(MAIL_NAP, max(deadline - time.monotonic(), 0)))
            waiting = self.missing(waiting, k)
            if waiting and lanes.woken:  # (with every message in, they count)
                raise LaneWoken()

    def post(self, parts: Sequence[Buffer], skip: int = 0) -> int:
        """Post the message ``parts`` make one after the other (at most a slot: the routes
        that take the mail fit, :data:`~burncoll.strategies.auto.MAIL_BYTES`); its number,
        the next but ``skip`` (the host gather's root skips the number of every node's
        message, which it reads and no one reads of its own: one wake of its sleepers, not
        two)."""
        k = self.posted_count + 1 + skip
        at, mine = self._slots[k & 1], self._maps[self._me]
        end = at + SLOT_BYTES
        for part in parts:
            size = memoryview(part).nbytes
            if at + size > end:  # (a wrong route: never into the other slot)
                raise ValueError("a message larger than a slot of the shared mail")
            mine[at:at + size] = part
            at += size
        self._counters[self._me][0] = k  # (after the message: x86-64 keeps stores in order)
        with self._barrier:  # (the counter is out before the sleepers' words are read)
            pass
        named = self._me + 1
        for line in self._other_lines:
            if line[1] == named:
                self._futex.wake(self._addresses[self._me])
                break
        self.posted_count = k
        return k

    def sleep(self, node: int, k: int, seconds: float) -> None:
        """Sleep until ``node`` posts its message number ``k`` (if it has not), or for
        ``seconds`` at most."""
        seen = int(self._counters[node][0])
        if seen < k:
            mine = self._counters[self._me]
            mine[1] = node + 1  # (before the kernel compares the counter: see the module)
            try:
                self._futex.wait(self._addresses[node], seen & 0xFFFFFFFF, seconds)
            finally:
                mine[1] = 0

    def posted(self, node: int, k: int) -> bool:
        """Whether ``node`` posted its message number ``k``."""
        return int(self._counters[node][0]) >= k

    def missing(self, nodes: Iterable[int], k: int) -> list[int]:
        """Those of ``nodes`` that have not posted their message number ``k``."""
        counters = self._counters
        return [n for n in nodes if int(counters[n][0]) < k]

    def read_all(self, nodes: Iterable[int], k: int, size: int) -> dict[int, memoryview]:
        """:meth:`read` of every node of ``nodes``, by node."""
        at = self._slots[k & 1]
        end, maps = at + min(size, SLOT_BYTES), self._maps
        return {n: memoryview(maps[n])[at:end] for n in nodes}

    def read(self, node: int, k: int, size: int) -> memoryview:
        """The first ``size`` bytes of ``node``'s message number ``k``: a view of its slot,
        which ``node`` writes again only after this node posted message ``k + 1``."""
        at = self._slots[k & 1]
        return memoryview(self._maps[node])[at:at + min(size, SLOT_BYTES)]

    def pending(self, size: int) -> dict[int, bytes]:
        """For an operation that is no exchange: the first ``size`` bytes of every message
        another node posted that this node has not (it called an exchange in this node's
        place, or is ahead)."""
        k = self.posted_count + 1
        return {n: bytes(self.read(n, k, size)) for n in self._maps
                if n != self._me and self.posted(n, k)}
