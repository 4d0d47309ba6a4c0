"""Zero-copy writes to a stream socket, beside the asyncio transport that reads it.

``asyncio``'s socket transport (Python 3.11) copies whatever the kernel does not take at once
into its own ``bytearray`` and sends it from there: for array-sized messages, one more pass over
every byte. :class:`SocketWriter` instead keeps the caller's buffers (memoryviews) queued and
hands them to ``sendmsg`` as the socket drains; the sender waits (:meth:`SocketWriter.sent`)
until its bytes are in the kernel before it may touch the memory again.

It writes on the transport's own socket and descriptor. The selector event loop keeps one
(reader, writer) pair of callbacks per descriptor, so the writer's callback sits beside the
transport's reader, as the transport's own would; but the public ``add_writer`` refuses a
descriptor a transport owns, so the loop's ``_add_writer`` is used (what the transport itself
calls). That is safe because the transport never watches for writing itself: its write buffer
stays empty, every write of a protocol with a writer goes here (:mod:`~burncoll.transport.stream`);
and it closes its socket only after ``connection_lost``, which closes the writer first. On a
loop without ``_add_writer`` (not a selector loop), a duplicate of the socket (``socket.dup``:
one more descriptor) is watched instead. Plain TCP only: TLS must encrypt in the transport.
Every method runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from burncoll.errors import TransportError

__all__ = ["SocketWriter", "fresh_error"]

#: Buffers per ``sendmsg`` call (Linux allows 1024).
_IOV_BATCH = 512


def fresh_error(error: TransportError) -> TransportError:
    """A copy of ``error`` to raise (same class, message and attributes, no traceback).

    A connection keeps the reason it failed and raises it to every later caller. Raising the
    kept object itself would attach a traceback whose frames hold the connection's protocol,
    which holds the error: a reference cycle that keeps the connection's buffers alive until a
    garbage collection. Raise a copy instead.
    """
    try:
        fresh = copy.copy(error)
    except Exception:  # a subclass whose constructor copy cannot call
        fresh = type(error).__new__(type(error))
        fresh.args = error.args
        fresh.__dict__.update(error.__dict__)
    fresh.__traceback__ = None
    return fresh


def _ignore(exc: OSError) -> None:
    """The error callback of a closed writer."""


class SocketWriter:
    """Sends queued buffers in order without copying them; see the module docstring.

    Offsets count the bytes ever queued: :meth:`write` returns the offset at which its buffers
    are all sent, and :meth:`sent` waits for an offset.
    """

    def __init__(self, sock: socket.socket, on_error: Callable[[OSError], None], *,
                 shared: bool = False) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = loop = asyncio.get_running_loop()
        #: ``sock`` is the transport's (watched through the loop's private calls, never closed
        #: here) rather than a duplicate of it; see the module docstring.
        self._shared = shared
        selector: Any = loop  # a selector loop, when shared
        self._add_writer = selector._add_writer if shared else loop.add_writer
        self._remove_writer = selector._remove_writer if shared else loop.remove_writer
        self._on_error = on_error
        self._pending: deque[memoryview] = deque()
        self._queued = 0  # offset of the end of the queue
        self._sent = 0  # offset of the first byte not yet sent
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._watching = False
        self._when_empty: Callable[[], None] | None = None
        self.error: TransportError | None = None

    @classmethod
    def for_transport(cls, transport: asyncio.BaseTransport,
                      on_error: Callable[[OSError], None]) -> SocketWriter | None:
        """A writer beside ``transport``; ``None`` for TLS or when the socket is unavailable."""
        if transport.get_extra_info("sslcontext") is not None:
            return None
        wrapped = transport.get_extra_info("socket")
        if wrapped is None:
            return None
        own = getattr(wrapped, "_sock", None)  # inside asyncio.trsock.TransportSocket
        loop = asyncio.get_running_loop()
        if isinstance(own, socket.socket) and hasattr(loop, "_add_writer"):
            return cls(own, on_error, shared=True)
        try:
            sock = wrapped.dup()
            sock.setblocking(False)
        except OSError:
            return None
        return cls(sock, on_error)

    @property
    def pending_bytes(self) -> int:
        return self._queued - self._sent

    def write(self, buffers: Sequence[memoryview]) -> int:
        """Queue ``buffers`` (flat byte views) after everything before; send what the socket
        takes now. Returns the offset at which they are all sent."""
        if self.error is not None:
            raise fresh_error(self.error)
        for buffer in buffers:
            if len(buffer):
                self._pending.append(buffer)
                self._queued += len(buffer)
        queued = self._queued
        if not self._watching:
            self._flush()
        return queued

    def sent(self, offset: int) -> asyncio.Future[None] | None:
        """A future resolved once the bytes before ``offset`` are sent; ``None`` if they are."""
        if self._sent >= offset:
            return None
        if self.error is not None:
            raise fresh_error(self.error)
        waiter = self._loop.create_future()
        self._waiters.append((offset, waiter))
        return waiter

    def when_empty(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once everything queued is sent (now, if it is)."""
        if not self._pending:
            callback()
        else:
            self._when_empty = callback

    def _flush(self) -> None:
        pending = self._pending
        failure: OSError | None = None
        try:
            while pending:
                if len(pending) == 1:
                    n = self._sock.send(pending[0])
                else:
                    n = self._sock.sendmsg(list(itertools.islice(pending, _IOV_BATCH)))
                self._advance(n)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            failure = exc
        if failure is not None:
            on_error = self._on_error
            self.close(TransportError(f"sending failed: {failure}"))
            on_error(failure)
            return
        if pending and not self._watching:
            self._add_writer(self._fd, self._flush)
            self._watching = True
        elif not pending and self._watching:
            self._remove_writer(self._fd)
            self._watching = False
        waiters = self._waiters
        while waiters and waiters[0][0] <= self._sent:
            _, waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        if not pending and self._when_empty is not None:
            callback, self._when_empty = self._when_empty, None
            callback()

    def _advance(self, n: int) -> None:
        self._sent += n
        pending = self._pending
        while n:
            head = pending[0]
            if len(head) <= n:
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = head[n:]
                n = 0

    def close(self, error: TransportError) -> None:
        """Stop: drop what is queued, fail the waiters with (a copy of) ``error``, forget the
        error callback; idempotent."""
        if self._watching:
            self._remove_writer(self._fd)
            self._watching = False
        if self.error is None:
            self.error = error
        self._pending.clear()
        if not self._shared:
            self._sock.close()
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(fresh_error(error))
                waiter.exception()  # retrieved: its sender may be gone
        self._when_empty = None
        self._on_error = _ignore  # no reference back to the protocol (no cycle)
