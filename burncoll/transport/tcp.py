"""Plain TCP transport, and the fast message core that the WebSocket transport shares.

Wire: the client opens with an 8-byte preamble (:data:`PREAMBLE`); after it, each message is
an 8-byte little-endian length (:data:`~burncoll.transport.wire.LENGTH_PREFIX_BYTES`) followed by
that many bytes, in both directions. Authentication (:mod:`burncoll.transport.auth`) runs above
it, as on every transport. No TLS: choose ``websocket`` with TLS settings (wss) to encrypt.

The core, :class:`StreamProtocol`, is an :class:`asyncio.BufferedProtocol` that avoids copying
array bytes:

* **before authentication** (:meth:`StreamConnection.authenticated`): at most
  :data:`~burncoll.transport.base.PREAUTH_BYTES` bytes are read from the socket in all
  (preamble or HTTP upgrade included): the buffer handed to the kernel is never larger than
  what is left of that budget, so bytes a stranger pipelines behind its handshake stay in the
  kernel; a frame whose header announces more than is left is refused at once, before anything
  is allocated (:class:`~burncoll.ProtocolError` naming the pre-authentication limit). The
  scratch buffer is that small, the socket's kernel buffers keep their defaults, and one
  message at a time is parsed (the next is parsed when ``recv`` takes this one, so a message
  pipelined behind the authentication exchange is read under the limits in force once the
  exchange is done). A listener's connections are admitted, capped and dropped when they do
  not authenticate in time by an :class:`~burncoll.transport.admission.Admission`.
* **receive**: small messages are parsed out of a 256 KiB scratch buffer that the kernel fills;
  a message whose payload does not fit is given its own uninitialised buffer
  (``numpy.empty``: no zero-filling), and the kernel then writes the rest of it *directly* into
  that buffer. The message handed to ``recv`` is that buffer: one copy in all, the kernel's.
* **send**: the header and each part are queued without being joined (small messages
  excepted) on a :class:`~burncoll.transport.writer.SocketWriter`, which hands them to
  ``sendmsg`` as the socket drains; ``send`` returns once they are in the kernel. Small
  messages are joined into one buffer and ``send`` returns at once, unless more than
  :data:`WRITE_HIGH_WATER` bytes are pending. Over TLS, the transport's ``write`` (it copies).

A subclass supplies the framing: :meth:`StreamProtocol.parse` (one header at a time) and
:meth:`StreamProtocol.frame_header`. :class:`TcpProtocol` is the length-prefixed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.admission import Admission, BoundedLog, Ticket
from burncoll.transport.base import (
    PREAUTH_BYTES,
    Buffer,
    Connection,
    Handler,
    Listener,
    Transport,
    byte_view,
    format_address,
)
from burncoll.transport.tls import binding_of_certificate
from burncoll.transport.wire import DEFAULT_MAX_MESSAGE_BYTES, LENGTH_PREFIX_BYTES, Placed
from burncoll.transport.writer import SocketWriter, fresh_error

__all__ = [
    "PREAMBLE",
    "StreamConnection",
    "StreamListener",
    "StreamProtocol",
    "TcpTransport",
    "byte_view",
    "format_address",
]

logger = logging.getLogger("burncoll.transport")
#: WARNING lines about strangers (bad handshakes, silence), bounded: a flood cannot fill the log.
stranger_log = BoundedLog()

#: The first bytes a TCP client sends: a listener drops a connection that opens otherwise.
PREAMBLE = b"BCTCP\x00\x01\n"
#: Bytes of the receive scratch buffer; larger messages get a buffer of their own.
SCRATCH_BYTES = 256 * 1024
#: Messages up to this size are joined with their header into one write.
JOIN_BYTES = 64 * 1024
#: ``send`` waits while more than this many bytes wait in the transport's buffer.
WRITE_HIGH_WATER = 16 * 1024 * 1024
#: Reading pauses while more than this many received bytes wait for ``recv``.
RECV_QUEUE_BYTES = 16 * 1024 * 1024
#: Socket buffer sizes asked of the kernel (it may grant less).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: How long ``Listener.close`` lets handlers finish before cancelling them.
HANDLER_GRACE = 1.0


def _set_no_delay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _enlarge_socket_buffers(transport: asyncio.BaseTransport) -> None:
    """Ask the kernel for :data:`SOCKET_BUFFER_BYTES` socket buffers (only once the peer has
    authenticated: a stranger gets the kernel's defaults)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # the kernel's defaults then
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def _binding_of_peer(transport: asyncio.BaseTransport) -> bytes:
    """The channel binding of the certificate the other end presented (``b""`` without TLS)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    der = ssl_object.getpeercert(binary_form=True)
    return binding_of_certificate(der) if der else b""


def _host_of(address: Any) -> str:
    """The host part of a socket address (what admission counts sources by)."""
    return str(address[0]) if isinstance(address, tuple) and address else "?"


class StreamProtocol(asyncio.BufferedProtocol):
    """Receives framed messages into their own buffers; see the module docstring.

    Args:
        max_message_bytes: the largest message accepted once authenticated.
        admission: on a listener's side, the :class:`Admission` that admits this connection
            when it is accepted (refused: it is closed before anything is read).
        binding: on a listener's side, :meth:`StreamConnection.channel_binding` (the
            listener's certificate's binding over TLS, ``b""`` without); ``None`` on a
            connecting side, which reads it off the certificate it receives.
    """

    def __init__(self, max_message_bytes: int, *, admission: Admission | None = None,
                 binding: bytes | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.transport: asyncio.Transport | None = None
        self.remote = "?"
        self.binding = binding
        self._admission = admission
        self._ticket: Ticket | None = None
        #: Bytes that may still be read before authentication; ``None`` once authenticated.
        self._budget: int | None = PREAUTH_BYTES
        self._budget_paused = False  # reading paused because the budget is spent
        self._scratch = bytearray(PREAUTH_BYTES)
        self._view = memoryview(self._scratch)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._direct: memoryview | None = None  # where the current large payload goes
        self._direct_filled = 0
        self._direct_done: Callable[[memoryview], None] | None = None
        self._direct_placed = False  # _direct is memory a placer chose
        self._messages: deque[Buffer | Placed] = deque()
        #: Chooses where a large message's payload is received (see :meth:`expect_payload`).
        self.placer: Callable[[memoryview, int], tuple[int, memoryview] | None] | None = None
        self._queued = 0
        self._reading_paused = False
        self._recv_waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._writer: SocketWriter | None = None
        #: Why the connection is unusable (the first reason wins); recv raises it when empty.
        self.error: TransportError | None = None
        self.lost = asyncio.get_running_loop().create_future()

    # -- framing, supplied by subclasses -------------------------------------------------------
    def parse(self, view: memoryview) -> int:
        """Consume one frame's header (and its payload when it is all in ``view``).

        Returns the bytes consumed; 0 when more bytes are needed. To receive a payload
        directly, call :meth:`expect_payload` and return the header's length plus what of the
        payload ``view`` holds.
        """
        raise NotImplementedError

    def frame_header(self, size: int) -> bytes:
        """The bytes that go before a message of ``size`` bytes."""
        raise NotImplementedError

    def sends_plain(self) -> bool:
        """Whether a message goes out as ``frame_header`` plus its bytes, unchanged."""
        return True

    # -- pre-authentication limits -------------------------------------------------------------
    @property
    def unauthenticated(self) -> bool:
        """Whether the pre-authentication limits are in force."""
        return self._budget is not None

    def over_budget(self, frame_bytes: int, have: int) -> bool:
        """Whether a frame of ``frame_bytes`` (header included), of which ``have`` bytes are
        buffered, needs more bytes than the pre-authentication budget has left."""
        return self._budget is not None and frame_bytes - have > self._budget

    def preauth_error(self) -> ProtocolError:
        """The error for a peer that goes past the pre-authentication budget."""
        return ProtocolError(
            f"message from {self.remote} exceeds the pre-authentication limit "
            f"({PREAUTH_BYTES} bytes): a peer may send no more before it authenticates")

    def authenticated(self) -> None:
        """Lift the pre-authentication limits: tell the admission ticket, grow the scratch
        buffer and the socket's kernel buffers, read on. Idempotent."""
        if self._budget is None:
            return
        self._budget = None
        if self._ticket is not None:
            self._ticket.authenticated()
        if self.transport is None or self.error is not None:
            return  # closed or failing: nothing more will be read
        left = self._end - self._start
        scratch = bytearray(SCRATCH_BYTES)
        scratch[:left] = self._view[self._start:self._end]
        self._scratch, self._view = scratch, memoryview(scratch)
        self._start, self._end = 0, left
        transport = self.transport
        _enlarge_socket_buffers(transport)
        if self._budget_paused:
            self._budget_paused = False
            if not self._reading_paused:
                transport.resume_reading()
        if self._start < self._end:
            self._parse_buffered()

    def drop(self, reason: str) -> None:
        """Close the connection at once (an admission evicted it or its deadline passed)."""
        self.fail(TransportError(f"dropped the connection from {self.remote}: {reason}"))
        self._direct = None
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = format_address(peer)
        if self._admission is not None:
            self._ticket = self._admission.admit(_host_of(peer), self.drop)
            self._admission = None
            if self._ticket is None:  # refused (and logged)
                self.fail(TransportError(f"refused the connection from {self.remote}: too "
                                         "many connections"))
                transport.abort()
                return
        if self.binding is None:  # a connecting side: the listener's certificate, if any
            self.binding = _binding_of_peer(transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        _set_no_delay(transport)
        self._writer = SocketWriter.for_transport(transport, self._write_failed)

    def handed_over(self, transport: asyncio.Transport, ticket: Ticket) -> None:
        """Start on ``transport`` with the admission ``ticket`` a :class:`TlsGate` took for
        the connection before its TLS handshake (no second admission): ``connection_made``,
        then parse what arrived between the handshake and now."""
        self._admission = None
        self._ticket = ticket
        self.connection_made(transport)
        if self.error is not None or self.transport is None:
            return
        if self._budget is not None and self._budget <= 0:
            self._pause_for_budget()
        if self._start < self._end:
            self._parse_buffered()

    def _write_failed(self, exc: OSError) -> None:
        self.fail(TransportError(f"sending to {self.remote} failed: {exc}"))
        if self.transport is not None:
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            view = self._direct[self._direct_filled:]
        else:
            if self._end == len(self._scratch):
                self._compact()
            view = self._view[self._end:]
        budget = self._budget
        if budget is not None and len(view) > budget:
            # Before authentication the kernel may hand over no more than the budget left
            # (reading is paused once it is spent, so it is never 0 here).
            view = view[:max(budget, 1)]
        return view

    def buffer_updated(self, nbytes: int) -> None:
        if self._budget is not None:
            self._budget -= nbytes
            if self._budget <= 0:
                self._pause_for_budget()
        if self.transport is None:
            # TLS bytes that follow the handshake before :class:`TlsGate` hands the connection
            # over (at most one buffer, under the budget): parsed by :meth:`handed_over`.
            self._end += nbytes
            return
        if self._direct is not None:
            self._direct_filled += nbytes
            if self._direct_filled == len(self._direct):
                direct, done = self._direct, self._direct_done
                self._direct, self._direct_done = None, None
                self._direct_placed = False
                assert done is not None
                done(direct)
            return
        self._end += nbytes
        self._parse_buffered()

    def _pause_for_budget(self) -> None:
        if not self._budget_paused and self.transport is not None:
            self._budget_paused = True
            self.transport.pause_reading()

    def _parse_buffered(self) -> None:
        """Parse what the scratch buffer holds; before authentication, stop after one message
        until ``recv`` takes it, and refuse a frame the spent budget cannot complete."""
        try:
            while self._direct is None and self._start < self._end and self.error is None:
                if self._budget is not None and self._messages:
                    break  # one message at a time before authentication
                used = self.parse(self._view[self._start:self._end])
                if used == 0:
                    if self._budget is not None and self._budget <= 0:
                        raise self.preauth_error()  # it can never be complete
                    break
                self._start += used
        except ProtocolError as exc:
            exc.__traceback__ = None  # its frames hold this protocol: no cycle
            self.protocol_error(exc)
            return
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > len(self._scratch) // 2:
            self._compact()

    def _compact(self) -> None:
        left = self._end - self._start
        if left == len(self._scratch):  # pragma: no cover - parse never needs this much
            self.protocol_error(ProtocolError("a frame header longer than the scratch buffer"))
            return
        self._scratch[:left] = self._view[self._start:self._end]
        self._start, self._end = 0, left

    def expect_payload(self, size: int, have: memoryview,
                       done: Callable[[memoryview], None], message: bool = True) -> None:
        """Receive a payload of ``size`` bytes, of which ``have`` arrived, into its own buffer;
        ``done(buffer)`` is called once it is complete.

        ``message``: the payload is a whole message. Then :attr:`placer`, when set, may name
        where its bytes go: ``placer(have, size)`` returns ``(head, destination)`` -- the
        message's first ``head`` bytes (all in ``have``) are kept apart and the rest is read
        straight into ``destination`` -- and the message is delivered as a
        :class:`~burncoll.transport.wire.Placed`.
        """
        if message and self.placer is not None:
            placement = self.placer(have, size)
            if placement is not None:
                head_size, destination = placement
                head = bytes(have[:head_size])
                self._receive_into(destination, have[head_size:],
                                   lambda filled: self.deliver(Placed(head, filled)))
                self._direct_placed = self._direct is not None
                return
        buffer = memoryview(np.empty(size, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]
        self._receive_into(buffer, have, done)

    def divert(self) -> None:
        """Place nothing more, and stop filling memory a placer chose (its operation failed,
        its owner may use it again): the rest of a payload in flight goes to a buffer of this
        protocol's own."""
        self.placer = None
        if self._direct is not None and self._direct_placed:
            spare = np.empty(len(self._direct), dtype=np.uint8)
            self._direct = memoryview(spare).cast("B")  # type: ignore[arg-type]
            self._direct_placed = False

    def _receive_into(self, buffer: memoryview, have: memoryview,
                      done: Callable[[memoryview], None]) -> None:
        buffer[:len(have)] = have
        if len(have) == len(buffer):
            done(buffer)
            return
        self._direct, self._direct_filled, self._direct_done = buffer, len(have), done

    def deliver(self, message: Buffer | Placed) -> None:
        """A whole message: hand it to ``recv``."""
        self._messages.append(message)
        self._queued += len(message)
        if self._queued > RECV_QUEUE_BYTES and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._direct is not None or self._start != self._end:
            cut = " in the middle of a message"
        else:
            cut = ""
        reason = f": {exc}" if exc is not None else ""
        self.fail(TransportError(f"connection to {self.remote} closed{cut}{reason}"))
        if self._ticket is not None:
            self._ticket.release()
            self._ticket = None
        if self._writer is not None:
            assert self.error is not None
            self._writer.close(self.error)
        # Forget every callback that refers back to this protocol, and the transport (over
        # TLS, asyncio's SSL protocol keeps this one's methods): with no reference cycle left,
        # the buffers are freed as soon as the last outside reference goes.
        self._direct, self._direct_done, self.placer = None, None, None
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- failure ---------------------------------------------------------------------------------
    def fail(self, error: TransportError) -> None:
        """Record why the connection is unusable (the first reason wins) and wake ``recv``."""
        if self.error is None:
            self.error = error
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def protocol_error(self, error: ProtocolError) -> None:
        """The peer broke the framing: fail and drop the connection."""
        self.fail(error)
        self._direct = None
        if self.transport is not None:
            self.transport.abort()

    # -- used by the connection -------------------------------------------------------------------
    async def next_message(self) -> Buffer | Placed:
        if not self._messages and self._budget is not None and self._start < self._end:
            # The message held back before authentication (see _parse_buffered), parsed only
            # now: had the caller authenticated after taking the last one, the limits would be
            # lifted already.
            self._parse_buffered()
        while not self._messages:
            if self.error is not None:
                raise fresh_error(self.error)
            self._recv_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._recv_waiter
            finally:
                self._recv_waiter = None
        message = self._messages.popleft()
        self._queued -= len(message)
        if self._reading_paused and self._queued <= RECV_QUEUE_BYTES // 2 and self.transport:
            self._reading_paused = False
            if not self._budget_paused:
                self.transport.resume_reading()
        return message

    def write_message(self, views: list[memoryview], total: int) -> int | None:
        """Queue a whole message at once (no await: messages never interleave).

        Returns the writer offset to wait for before the caller may modify ``views`` (see
        :meth:`wait_sent`), or ``None`` when they were copied.
        """
        header = self.frame_header(total)
        if total <= JOIN_BYTES:
            self.write_bytes(b"".join([header, *views]))
            return None
        transport = self._open_transport()
        if self._writer is not None:
            return self._writer.write([memoryview(header), *views])
        transport.write(header)
        for view in views:
            if view:
                transport.write(view)
        return None

    def _write_backlog(self) -> int:
        """Bytes written but not yet handed to the kernel."""
        if self._writer is not None:
            return self._writer.pending_bytes
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def _open_transport(self) -> asyncio.Transport:
        transport = self.transport
        if self.error is not None:
            raise fresh_error(self.error)
        if transport is None or transport.is_closing():
            raise TransportError(f"connection to {self.remote} is closed")
        return transport

    def write_bytes(self, data: bytes | bytearray) -> None:
        """Queue ``data`` (the caller's to keep: it is not copied) after everything before."""
        transport = self._open_transport()
        if self._writer is not None:
            self._writer.write([memoryview(data)])
        else:
            transport.write(data)

    async def wait_sent(self, offset: int | None) -> None:
        """Wait until the bytes before ``offset`` are sent (``None``: until no more than
        :data:`WRITE_HIGH_WATER` bytes are pending)."""
        writer = self._writer
        if writer is None:
            if self._write_paused:
                await self.drain()
            return
        if offset is None:
            if writer.pending_bytes <= WRITE_HIGH_WATER:
                return
            offset = writer.write([]) - WRITE_HIGH_WATER
        waiter = writer.sent(offset)
        if waiter is not None:
            await waiter

    def close_after_writes(self) -> None:
        """Close the transport once everything queued is written."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._writer is not None and self._writer.error is None:
            self._writer.when_empty(transport.close)
        else:
            transport.close()

    async def drain(self) -> None:
        while self._write_paused and self.error is None:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
        if self.error is not None and (self.transport is None or self.transport.is_closing()):
            raise fresh_error(self.error)


class StreamConnection(Connection):
    """A :class:`Connection` over a :class:`StreamProtocol`."""

    def __init__(self, protocol: StreamProtocol, close_timeout: float = 2.0) -> None:
        self._protocol = protocol
        self.remote = protocol.remote
        self.close_timeout = close_timeout
        self._closing = False

    def send_now(self, parts: Sequence[Buffer]) -> bool:
        protocol = self._protocol
        writer = protocol._writer
        if writer is None or self._closing or protocol.error is not None or not (
                protocol.sends_plain()):
            return False
        views = [byte_view(p) for p in parts]
        total = sum(len(v) for v in views)
        if total > JOIN_BYTES:
            return False  # a large message waits on the loop until it is sent
        return writer.write_now(b"".join([protocol.frame_header(total), *views]))

    def authenticated(self) -> None:
        self._protocol.authenticated()

    def channel_binding(self) -> bytes:
        return self._protocol.binding or b""

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._protocol.transport

    async def send(self, parts: Sequence[Buffer]) -> None:
        if self._closing:
            raise TransportError(f"the connection to {self.remote} was closed")
        views = [byte_view(p) for p in parts]
        total = sum(len(v) for v in views)
        protocol = self._protocol
        try:
            offset = protocol.write_message(views, total)
        except (OSError, RuntimeError) as exc:
            raise TransportError(f"sending to {self.remote} failed: {exc}") from exc
        await protocol.wait_sent(offset)

    async def recv(self) -> Buffer | Placed:
        return await self._protocol.next_message()

    def place_with(self, placer: Callable[[memoryview, int], tuple[int, memoryview] | None]
                   ) -> None:
        self._protocol.placer = placer

    def stop_placing(self) -> None:
        self._protocol.divert()

    def goodbye(self) -> None:
        """Called once before the transport closes (a WebSocket sends its close frame)."""

    async def close(self) -> None:
        protocol = self._protocol
        if not self._closing:
            self._closing = True
            transport = protocol.transport
            if transport is not None and not transport.is_closing():
                with contextlib.suppress(OSError, RuntimeError, TransportError):  # closing anyway
                    self.goodbye()
                protocol.close_after_writes()  # flushes what was written, then closes
            protocol.fail(TransportError(f"the connection to {self.remote} was closed"))
        try:
            await asyncio.wait_for(asyncio.shield(protocol.lost), self.close_timeout)
        except TimeoutError:
            if protocol.transport is not None:
                protocol.transport.abort()


class TcpProtocol(StreamProtocol):
    """Length-prefixed messages after a preamble from the client."""

    def __init__(self, max_message_bytes: int, server: bool,
                 on_open: Callable[[TcpProtocol], None] | None = None,
                 preamble_timeout: float = 10.0, admission: Admission | None = None) -> None:
        super().__init__(max_message_bytes, admission=admission,
                         binding=b"" if server else None)
        self._await_preamble = server
        self._on_open = on_open
        self._preamble_timeout = preamble_timeout
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.error is not None:  # refused
            return
        if not self._await_preamble:
            self.write_bytes(PREAMBLE)
        else:  # a stranger that says nothing is dropped, not held forever
            self._timer = asyncio.get_running_loop().call_later(
                self._preamble_timeout, self._silent)

    def _silent(self) -> None:
        self._timer = None
        if self._await_preamble and self.transport is not None:
            stranger_log.warning("silent", f"dropped a connection from {self.remote}: no "
                                 f"preamble within {self._preamble_timeout:g} s")
            self.protocol_error(ProtocolError(
                f"{self.remote} sent no preamble within {self._preamble_timeout:g} s"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_open = None
        super().connection_lost(exc)

    def parse(self, view: memoryview) -> int:
        if self._await_preamble:
            if len(view) < len(PREAMBLE):
                if bytes(view) != PREAMBLE[:len(view)]:
                    raise ProtocolError(f"stream opened with {bytes(view)!r}: not a burncoll peer")
                return 0
            if bytes(view[:len(PREAMBLE)]) != PREAMBLE:
                raise ProtocolError(
                    f"stream opened with {bytes(view[:len(PREAMBLE)])!r}: not a burncoll peer")
            self._await_preamble = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._on_open is not None:
                self._on_open(self)
            return len(PREAMBLE)
        if len(view) < LENGTH_PREFIX_BYTES:
            return 0
        size = int.from_bytes(view[:LENGTH_PREFIX_BYTES], "little")
        if self.over_budget(LENGTH_PREFIX_BYTES + size, len(view)):
            raise self.preauth_error()
        if size > self.max_message_bytes:
            raise ProtocolError(
                f"message from {self.remote} exceeds the size limit ({size} bytes announced, "
                f"limit {self.max_message_bytes})"
            )
        body = view[LENGTH_PREFIX_BYTES:]
        if len(body) >= size:
            self.deliver(bytes(body[:size]))
            return LENGTH_PREFIX_BYTES + size
        if size <= JOIN_BYTES:
            return 0  # a small message: wait until it is all in the scratch buffer
        self.expect_payload(size, body, self.deliver)
        return len(view)

    def frame_header(self, size: int) -> bytes:
        return size.to_bytes(LENGTH_PREFIX_BYTES, "little")


class StreamListener(Listener):
    """A bound server; each accepted connection runs the handler in its own task.

    ``admission`` (a default :class:`Admission` when ``None``) admits every accepted
    connection; the protocol factory passes it to each protocol.
    """

    def __init__(self, host: str, port: int, admission: Admission | None = None) -> None:
        self.host = host
        self.port = port
        self.admission = admission if admission is not None else Admission()
        self._server: asyncio.Server | None = None
        self._handler_tasks: set[asyncio.Task[Any]] = set()
        #: TLS handshakes under way (:class:`TlsGate`); held here so that none is collected.
        self._handshakes: set[asyncio.Task[None]] = set()
        self._connections: set[StreamConnection] = set()
        self._closing: asyncio.Task[None] | None = None

    def bind(self, server: asyncio.Server) -> None:
        self._server = server
        sockname = server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]
        self.admission.name = f"listener {format_address(sockname)}"

    def start(self, conn: StreamConnection, handler: Handler) -> None:
        """Run ``handler(conn)`` in a task of its own (unless the listener is closing)."""
        if self._closing is not None:
            if conn._protocol.transport is not None:
                conn._protocol.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._serve(conn, handler))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _serve(self, conn: StreamConnection, handler: Handler) -> None:
        self._connections.add(conn)
        try:
            await handler(conn)
        except TransportError as exc:
            logger.debug("connection from %s ended: %s", conn.remote, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("handler for the connection from %s failed", conn.remote)
        finally:
            self._connections.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._server is None:
            return
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close(self._server))
        await asyncio.shield(self._closing)

    async def _close(self, server: asyncio.Server) -> None:
        server.close()  # stop accepting
        self.admission.close()  # drops the connections still waiting to authenticate
        if self._handshakes:  # each ends at once: its connection was aborted
            await asyncio.wait(list(self._handshakes), timeout=HANDLER_GRACE)
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(c.close() for c in connections))
        tasks = list(self._handler_tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=HANDLER_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                _, stuck = await asyncio.wait(pending, timeout=HANDLER_GRACE)
                if stuck:
                    logger.warning("listener %s:%s: a handler ignored cancellation",
                                   self.host, self.port)


class TlsGate(asyncio.Protocol):
    """A TLS listener's first protocol on an accepted TCP connection: admission comes before
    the TLS handshake, so that the pre-authentication caps and deadline cover it.

    asyncio's own ``create_server(ssl=...)`` calls the application protocol's
    ``connection_made`` only once the handshake is done; until then each accepted socket holds
    a file descriptor, an OpenSSL object and TLS buffers that no cap counts. Instead:

    1. ``connection_made`` pauses reading and takes the connection's
       :class:`~burncoll.transport.admission.Ticket` at once (refused: aborted). Until the
       hand-over, an eviction or the pre-authentication deadline aborts the TCP connection.
    2. ``loop.start_tls`` runs the handshake, within ``handshake_timeout`` (the caller passes
       at most the admission's ``preauth_seconds``).
    3. On success the application protocol (made by ``app_factory``) gets the ticket and the
       TLS transport (:meth:`StreamProtocol.handed_over`), and later drops go to its
       :meth:`StreamProtocol.drop`. On failure the ticket is released, the connection aborted,
       and the failure logged (bounded: :data:`stranger_log`) unless the admission dropped it
       (it logged that).
    """

    def __init__(self, app_factory: Callable[[], StreamProtocol], context: ssl.SSLContext,
                 admission: Admission, handshake_timeout: float,
                 handshakes: set[asyncio.Task[None]]) -> None:
        self._app_factory = app_factory
        self._context = context
        self._admission = admission
        self._handshake_timeout = handshake_timeout
        self._handshakes = handshakes
        self._raw: asyncio.Transport | None = None
        self._app: StreamProtocol | None = None
        self.remote = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # nothing is read before the handshake starts
        peer = transport.get_extra_info("peername")
        self.remote = format_address(peer)
        ticket = self._admission.admit(_host_of(peer), self._drop)
        if ticket is None:  # refused (and logged)
            transport.abort()
            return
        self._raw = transport
        task = asyncio.get_running_loop().create_task(self._handshake(transport, ticket))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def connection_lost(self, exc: Exception | None) -> None:
        """Lost before ``start_tls`` took the transport over: :meth:`_handshake` sees it
        closing and releases the ticket."""

    def _drop(self, reason: str) -> None:
        """The ticket's ``drop``: abort the TCP connection until the hand-over, then the
        application protocol's :meth:`~StreamProtocol.drop`."""
        if self._app is not None:
            self._app.drop(reason)
        elif self._raw is not None:
            self._raw.abort()

    async def _handshake(self, raw: asyncio.Transport, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        tls: asyncio.BaseTransport | None = None
        failure = "closed before the TLS handshake"
        if not raw.is_closing() and not ticket.released:
            app = self._app_factory()
            try:
                tls = await loop.start_tls(raw, app, self._context, server_side=True,
                                           ssl_handshake_timeout=self._handshake_timeout)
            except (OSError, TimeoutError, RuntimeError) as exc:
                failure = f"TLS handshake failed: {exc or type(exc).__name__}"
            else:
                failure = "closed during the TLS handshake"
            if (isinstance(tls, asyncio.Transport) and not tls.is_closing()
                    and not ticket.released):
                self._app, self._raw = app, None
                app.handed_over(tls, ticket)
                return
        self._raw = None
        evicted = ticket.released  # the admission dropped it, and logged why
        ticket.release()
        raw.abort()
        if not evicted:
            stranger_log.warning("tls", f"dropped a connection from {self.remote}: {failure}")


async def listen_stream(host: str, port: int, factory: Callable[[], StreamProtocol],
                        listener: StreamListener, *, context: ssl.SSLContext | None = None,
                        handshake_timeout: float = 10.0) -> None:
    """Bind ``listener`` to ``host:port`` serving ``factory``; TransportError naming the port.

    With ``context``, TLS: each connection is admitted by ``listener.admission`` before its
    TLS handshake (:class:`TlsGate`), which must end within ``handshake_timeout`` seconds and
    the admission's ``preauth_seconds``; ``factory``'s protocol gets the admitted connection
    once it is encrypted. Without, ``factory``'s protocol admits its connection itself.
    """
    loop = asyncio.get_running_loop()
    serve: Callable[[], asyncio.BaseProtocol] = factory
    if context is not None:
        admission, handshakes = listener.admission, listener._handshakes
        timeout = min(handshake_timeout, admission.preauth_seconds)

        def serve() -> TlsGate:
            return TlsGate(factory, context, admission, timeout, handshakes)

    try:
        server = await loop.create_server(serve, host, port)
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise TransportError(f"cannot listen on {host}:{port}: {reason}") from exc
    listener.bind(server)


class TcpTransport(Transport):
    """Length-prefixed messages on plain TCP (no TLS); see the module docstring.

    Args:
        max_message_bytes: the largest message this side accepts (once authenticated).
        connect_timeout: seconds for the TCP connect.
        close_timeout: seconds ``close`` waits for the written bytes to leave.
        admission: makes each listener's :class:`Admission` (its caps and pre-authentication
            deadline); the defaults when ``None``.
    """

    name = "tcp"

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float = 10.0, close_timeout: float = 2.0,
                 admission: Callable[[], Admission] | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.admission = admission or Admission

    async def listen(self, host: str, port: int, handler: Handler) -> StreamListener:
        listener = StreamListener(host, port, self.admission())
        close_timeout, max_message_bytes = self.close_timeout, self.max_message_bytes
        preamble_timeout, admission = self.connect_timeout, listener.admission

        def opened(protocol: TcpProtocol) -> None:
            listener.start(StreamConnection(protocol, close_timeout), handler)

        def factory() -> TcpProtocol:
            return TcpProtocol(max_message_bytes, server=True, on_open=opened,
                               preamble_timeout=preamble_timeout, admission=admission)

        await listen_stream(host, port, factory, listener)
        return listener

    async def connect(self, host: str, port: int) -> StreamConnection:
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: TcpProtocol(self.max_message_bytes, server=False), host, port)
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot connect to {netloc} over tcp: {exc}") from exc
        return StreamConnection(protocol, self.close_timeout)
