"""Caller sockets: one connection between every two nodes that the calling thread itself
writes and reads, for the one-round exchange of small operations.

**Why.** Through the event loop a small all-reduce costs two thread wake-ups per message (the
loop's, then the waiting peer thread's) and the two threads contend for the GIL; on two busy
CPUs that is most of the operation (two processes exchanging 40 bytes over TCP loopback:
9-11 us per round when the calling thread reads the socket itself, 59-68 us when a loop
thread reads it and wakes the caller). A lane takes the loop off that path.

**Setup.** At session start, once the member connections are up, the higher-indexed node of
every pair dials the lower one's data service once more, authenticated as every member
connection (challenge-response on the token or the session's secret), with a hello that says
``lane``. Both ends take the socket out of the event loop
(:meth:`~burncoll.transport.stream_connection.StreamConnection.detach`); the accepting end
then writes one byte, :data:`READY`, and the dialer counts the lane open only once it has read
it, so no byte of an exchange can reach a socket that the event loop still reads. A session
starts only with every lane open.

**When.** Every node says in the orchestrator's table whether it uses lanes (config
``caller_sockets``, on a plain stream transport: tcp or websocket, without TLS or integrity
tags, which need the event loop's codec); they are used only when every node does, and then
for exactly the operations whose route takes them: the one-round exchange on channel 0 (an
all-reduce up to the exchange limit; a barrier) on ``Medium.LANE``, and the host memory's
set-up at join and the host reduction's rounds (:mod:`burncoll.node.host_reduce`): every node
chooses the same route from the same call, and a node's channel-0 operations run one after
the other, so a lane carries, per direction and in operation order, one message per exchange
and one per round (each header names its operation and round).

**What is read.** Exactly the length this node's own call gives the other node's message
(header and payload), into a buffer of that size allocated before a byte is read: what a
sender announces allocates nothing. The header is then decoded and checked as the mailbox
checks a frame (session, operation number, channel, round, sender, chunk, offset, size,
fingerprint). A message that announces another length is read only as far as its header
(at most :data:`~burncoll.protocol.wire.MAX_NDIM` shape entries) and reported from it.

**Shared mail.** Among node processes of one host that set up their host memory at join,
the routes on ``Medium.HOST`` (and the host reduction's rounds) go through the shared mail
instead (:mod:`burncoll.node.host_mail`), and the lanes are only watched while a thread
waits for mail (:meth:`burncoll.node.host_mail.SharedMail.exchange`, :meth:`Lanes.watch`).

**Waiting.** Once its message is out, the thread reads without sleeping for a short while
where that pays (:mod:`burncoll.node.spinning`), then sleeps in ``poll``.

**Failures.** Every wait ends at the operation's deadline. A failure of the session (another
node's abort, a broken member connection, a wrong frame found by the mailbox) wakes the
waiting thread through a pipe (:meth:`Lanes.wake`). A lane that closes or breaks is the loss
of that node. The link (:class:`~burncoll.node.link.NodeLink`) turns each outcome into the
error the event loop's path raises.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from burncoll.node.spinning import Spinning, Yielding
from burncoll.protocol.wire import FIXED_HEADER_BYTES, announced_lengths

__all__ = ["READY", "LaneClosed", "LaneOdd", "LaneTimeout", "LaneWoken", "Lanes"]

#: The byte an accepting node writes once its end of a lane is out of the event loop.
READY = b"\x01"

_IN = select.POLLIN
#: The longest single wait of ``poll`` (its millisecond argument is a C int); a longer
#: timeout polls again.
_POLL_MAX_MS = 2**31 - 1
_OUT = select.POLLOUT
T = TypeVar("T")
class LaneTimeout(Exception):
    """The operation's deadline passed before ``node``'s message was in."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.node = node


class LaneClosed(Exception):
    """``node``'s lane closed or broke (``reason``)."""

    def __init__(self, node: int, reason: str) -> None:
        super().__init__(node, reason)
        self.node = node
        self.reason = reason


class LaneWoken(Exception):
    """The session failed while the exchange waited (:meth:`Lanes.wake`)."""


class LaneOdd(Exception):
    """``node``'s message announces another length than this node's call gives it;
    ``head`` holds its first bytes (its whole header, when that was well-formed)."""

    def __init__(self, node: int, head: bytes) -> None:
        super().__init__(node)
        self.node = node
        self.head = head


class Lanes:
    """This node's lanes by node index; empty until the session's are all open.

    Two locks: ``_using`` is held by the one exchange running (the lanes' only reader and
    writer); ``_state`` guards the flags and the wake-up pipe, so that :meth:`wake` and
    :meth:`close` never wait for an exchange. A lane closed while an exchange runs is closed
    by that exchange as it ends."""

    def __init__(self) -> None:
        self.socks: dict[int, socket.socket] = {}
        self._using = threading.Lock()
        self._state = threading.Lock()
        self._pipe: tuple[int, int] | None = None  # made with the first lane
        self._woken = False
        self._closed = False
        #: The sockets were dropped at join (:meth:`drop_sockets`): no lane is taken again.
        self._dropped = False
        #: How long an exchange reads without sleeping first (the link allows it).
        self.spinning = Spinning()
        #: Whether a wait for shared mail yields its CPU before it sleeps.
        self.yielding = Yielding()

    def add(self, node: int, sock: socket.socket) -> bool:
        """``node``'s lane; ``False`` (the socket closed) when it already has one, or the
        lanes are closed or their sockets dropped."""
        with self._state:
            if node in self.socks or self._closed or self._dropped:
                sock.close()
                return False
            if self._pipe is None:
                try:
                    self._pipe = os.pipe()
                except OSError:  # no descriptor left
                    sock.close()
                    raise
                for fd in self._pipe:
                    os.set_blocking(fd, False)
            sock.setblocking(False)
            self.socks[node] = sock
            return True

    def wake(self) -> None:
        """The session failed: an exchange waiting on the lanes raises :class:`LaneWoken`,
        now or whenever one starts. From any thread."""
        with self._state:
            self._woken = True
            if self._pipe is not None and not self._closed:
                with contextlib.suppress(OSError):  # full: already woken
                    os.write(self._pipe[1], b"!")

    def peek(self, size: int) -> dict[int, bytes]:
        """Up to ``size`` bytes waiting on each lane, left there (for error reports)."""
        waiting: dict[int, bytes] = {}
        if self._using.locked():  # an exchange reads them (and checks what it reads)
            return waiting
        with self._state:
            socks = [] if self._closed else list(self.socks.items())
            for node, sock in socks:
                try:
                    head = sock.recv(size, socket.MSG_PEEK)
                except OSError:  # nothing there (or closed)
                    continue
                if head:
                    waiting[node] = head
        return waiting

    def drop_sockets(self) -> None:
        """(At join, no exchange running.) Close every lane's socket, keeping the wake-up
        pipe: where the host mail carries every exchange, the lanes served only the join's
        host-memory handshake, and a wait for mail watches the pipe and the deadline alone (a
        lost node comes as the session's failure: its member connections, the orchestrator).
        A lane a member dials later is closed at once (:meth:`add`)."""
        with self._using, self._state:
            socks, self.socks, self._dropped = list(self.socks.values()), {}, True
        for sock in socks:
            sock.close()

    def close(self) -> None:
        """Close every lane and the wake-up pipe (at once, or as the running exchange
        ends: it is woken first)."""
        self.wake()
        with self._state:
            self._closed = True
        self._release_if_closed()

    def _release_if_closed(self) -> None:
        """Close the sockets and the pipe once closed, unless an exchange runs: it calls this
        again as it ends (whichever of the two comes second finds the lock free)."""
        if not self._closed or not self._using.acquire(blocking=False):
            return
        try:
            self._release()
        finally:
            self._using.release()

    def _release(self) -> None:
        """(Holding ``_using``, once closed.) Close the sockets and the pipe."""
        with self._state:
            socks, pipe = list(self.socks.values()), self._pipe
            self.socks, self._pipe = {}, None
        for sock in socks:
            sock.close()
        for fd in pipe or ():
            os.close(fd)

    def _break(self) -> None:
        """An exchange stopped half-way for a reason of this node's own (an interrupt, no
        memory): the other nodes must not read what is left as a message, so every lane is
        shut down (they see it closed) and no exchange runs again."""
        with self._state:
            self._woken = True
            for sock in self.socks.values():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def exchange(self, message: bytes, expected: int, deadline: float
                 ) -> dict[int, bytearray]:
        """Send ``message`` to every other node and receive exactly ``expected`` bytes of
        one message from each, by ``deadline``; raises :class:`LaneTimeout`,
        :class:`LaneClosed`, :class:`LaneWoken` or :class:`LaneOdd`. Anything else that
        stops it (``KeyboardInterrupt``) shuts every lane down first."""
        return self.alone(lambda wake: _SocketRound(self.socks, wake, message, expected).run(
            deadline, self.spinning))

    @property
    def woken(self) -> bool:
        """Whether the session failed (:meth:`wake`)."""
        return self._woken

    def alone(self, run: Callable[[int], T]) -> T:
        """``run(wake-up pipe)``, the lanes' only reader and writer meanwhile (see
        :meth:`exchange` for what ends it; the host mail's exchange runs so too)."""
        try:
            with self._using:
                if self._woken or self._closed or self._pipe is None:
                    raise LaneWoken()
                try:
                    return run(self._pipe[0])
                except (LaneWoken, LaneTimeout, LaneClosed, LaneOdd):
                    raise
                except BaseException:
                    self._break()
                    raise
        finally:
            self._release_if_closed()

    def watch(self, waiting: list[int], deadline: float, posted: Callable[[int], bool]
              ) -> None:
        """(In :meth:`alone`.) Whether anything ends a wait for ``waiting``'s messages in
        the host mail: the deadline, the wake-up pipe, or one of their lanes closed or holding
        a message (they sent an exchange on the sockets where this node expects mail, or a
        message this node does not expect). A node whose message is in by then (``posted``)
        is not blamed: what is there counts."""
        if time.monotonic() >= deadline:
            late = [n for n in waiting if not posted(n)]
            if late:
                raise LaneTimeout(late[0])
            return
        poller = select.poll()
        assert self._pipe is not None  # (checked by exchange)
        poller.register(self._pipe[0], _IN)
        node_of = {self.socks[n].fileno(): n for n in waiting if n in self.socks}
        for fd in node_of:
            poller.register(fd, _IN)
        for fd, _ in poller.poll(0):
            if fd not in node_of:
                if all(posted(n) for n in waiting):
                    return  # (woken with every message in: they count, as on the lanes)
                raise LaneWoken()
            node = node_of[fd]
            if posted(node):  # (posted since ``waiting`` was taken: what its lane
                continue              # holds is a later operation's, or its loss, seen later)
            try:
                head = self.socks[node].recv(1 << 10, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise LaneClosed(node, str(exc)) from None
            if not head:
                raise LaneClosed(node, "it closed the connection")
            if len(head) >= FIXED_HEADER_BYTES and len(head) >= announced_lengths(
                    memoryview(head)[:FIXED_HEADER_BYTES])[0]:
                raise LaneOdd(node, head)  # (a header whole: reported from it)


class _SocketRound:
    """One round on the lanes: what is left to send to, and to receive from, each node."""

    def __init__(self, socks: dict[int, socket.socket], wake: int, message: bytes,
                 expected: int) -> None:
        self.socks = socks
        self.wake = wake
        self.expected = expected
        self.unsent = {n: memoryview(message) for n in socks}
        self.bufs = {n: bytearray(expected) for n in socks}
        self.have = dict.fromkeys(socks, 0)
        self.want = dict.fromkeys(socks, expected)
        self.odd: set[int] = set()
        self.node_of = {s.fileno(): n for n, s in socks.items()}

    def run(self, deadline: float, spinning: Spinning) -> dict[int, bytearray]:
        for node in list(self.unsent):
            self._send(node)
        waiting = set(self.socks)
        began = time.perf_counter()
        if not self.unsent:
            self._spin(waiting, began + spinning.budget())
        while waiting or self.unsent:
            poller = select.poll()
            poller.register(self.wake, _IN)
            for node in waiting | set(self.unsent):
                events = (_IN if node in waiting else 0) | (_OUT if node in self.unsent else 0)
                poller.register(self.socks[node], events)
            left = deadline - time.monotonic()  # past it: what is there already still counts
            ready = poller.poll(min(max(int(left * 1000) + 1, 0), _POLL_MAX_MS))
            if not ready and time.monotonic() >= deadline:
                raise LaneTimeout(min(waiting or self.unsent))
            for fd, events in ready:
                if fd == self.wake:
                    self._woken(waiting)
                    break
                node = self.node_of[fd]
                if node in self.unsent and events & (_OUT | select.POLLERR | select.POLLHUP):
                    self._send(node)
                if node in waiting and events & ~_OUT and self._receive(node):
                    waiting.discard(node)
        spinning.waited(time.perf_counter() - began)
        return self.bufs

    def _woken(self, waiting: set[int]) -> None:
        """The session failed meanwhile: what has come in still counts. The round ends with
        every message in (its failure is then the next operation's, as on the node that sent
        last and left), else :class:`LaneWoken`."""
        for node in list(self.unsent):
            self._send(node)
        for node in list(waiting):
            if self._receive(node):
                waiting.discard(node)
        if waiting or self.unsent:
            raise LaneWoken()

    def _spin(self, waiting: set[int], until: float) -> None:
        """Read what has come in without sleeping, until ``until`` or until all is in."""
        while waiting and time.perf_counter() < until:
            for node in list(waiting):
                if self._receive(node):
                    waiting.discard(node)

    def _send(self, node: int) -> None:
        view = self.unsent[node]
        try:
            sent = self.socks[node].send(view)
        except BlockingIOError:
            return
        except OSError as exc:
            raise LaneClosed(node, f"sending failed: {exc}") from None
        if sent == len(view):
            del self.unsent[node]
        else:
            self.unsent[node] = view[sent:]

    def _receive(self, node: int) -> bool:
        """Read what is there of ``node``'s message; whether it is complete."""
        have, want, buf = self.have[node], self.want[node], self.bufs[node]
        try:
            got = self.socks[node].recv_into(memoryview(buf)[have:want])
        except BlockingIOError:
            return False
        except OSError as exc:
            raise LaneClosed(node, str(exc)) from None
        if got == 0:
            raise LaneClosed(node, "it closed the connection")
        have += got
        self.have[node] = have
        if have - got < FIXED_HEADER_BYTES <= have:  # the fixed header just came in
            header, whole = announced_lengths(memoryview(buf)[:FIXED_HEADER_BYTES])
            if whole != self.expected:  # read no further than its header
                self.odd.add(node)
                self.want[node] = want = max(header, have)
                if want > len(buf):
                    buf.extend(bytes(want - len(buf)))
        if have < self.want[node]:
            return False
        if node in self.odd:
            raise LaneOdd(node, bytes(buf[:have]))
        return True
