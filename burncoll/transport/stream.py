"""The zero-copy stream core that the TCP and WebSocket transports share.

:class:`StreamProtocol` is an :class:`asyncio.BufferedProtocol` that avoids copying array
bytes; a subclass supplies the framing (:meth:`StreamProtocol.parse`, one header at a time,
and :meth:`StreamSending.frame_header`):

* **before authentication** (:meth:`StreamProtocol.authenticated`): at most
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
* **receive**: small messages are parsed out of a scratch buffer that the kernel fills (the
  pre-authentication one, 16 KiB, grown 4x at a time up to :data:`SCRATCH_BYTES` only when a
  frame fills it: a connection of small frames never holds more); a message whose payload does
  not fit is given its own uninitialised buffer
  (``numpy.empty``: no zero-filling), or memory its receiver chose (a *placer*, see
  :meth:`StreamProtocol.expect_payload`), and the kernel then writes the rest of it
  *directly* there. One copy in all, the kernel's.
* **send** (:class:`StreamSending`): the header and each part of a message are queued
  without being joined (small messages excepted) on a
  :class:`~burncoll.transport.writer.SocketWriter`, which hands them to ``sendmsg`` as the
  socket drains; ``send`` returns once they are in the kernel. Small messages (up to
  :data:`JOIN_BYTES`) are joined into one buffer and ``send`` returns at once, unless more
  than :data:`WRITE_HIGH_WATER` bytes are pending. Over TLS the writer cannot be used (TLS
  encrypts in the transport): the transport's ``write`` then (it copies).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import Placed
from burncoll.transport.admission import Admission, Ticket
from burncoll.transport.base import PREAUTH_BYTES, Buffer, Placer, format_address
from burncoll.transport.tls import binding_of_certificate
from burncoll.transport.writer import SocketWriter, fresh_error

__all__ = ["JOIN_BYTES", "RECV_QUEUE_BYTES", "SCRATCH_BYTES", "WRITE_HIGH_WATER", "StreamProtocol",
           "StreamSending"]

#: Messages up to this size are joined with their header into one write (and received
#: whole in the scratch buffer).
JOIN_BYTES = 64 * 1024
#: ``send`` waits while more than this many bytes wait in the transport's buffer.
WRITE_HIGH_WATER = 16 * 1024 * 1024
#: Socket buffer sizes asked of the kernel (it may grant less).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def set_no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small messages at once (no Nagle delay)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def enlarge_socket_buffers(transport: asyncio.BaseTransport) -> None:
    """Ask the kernel for :data:`SOCKET_BUFFER_BYTES` socket buffers (only once the peer has
    authenticated: a stranger gets the kernel's defaults)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # the kernel's defaults then
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def binding_of_peer(transport: asyncio.BaseTransport) -> bytes:
    """The channel binding of the certificate the other end presented (``b""`` without TLS)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    der = ssl_object.getpeercert(binary_form=True)
    return binding_of_certificate(der) if der else b""


def host_of(address: Any) -> str:
    """The host part of a socket address (what admission counts sources by)."""
    return str(address[0]) if isinstance(address, tuple) and address else "?"


class StreamSending(abc.ABC):
    """What every stream protocol holds -- its transport, the other end's address, why it
    failed -- and how it sends; the framing supplies :meth:`frame_header`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        #: ``"host:port"`` of the other end, for messages and logs.
        self.remote = "?"
        #: Why the connection is unusable (the first reason wins); recv raises it when empty.
        self.error: TransportError | None = None
        self._writer: SocketWriter | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    @abc.abstractmethod
    def frame_header(self, size: int) -> bytes:
        """The bytes that go before a message of ``size`` bytes."""

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

    def close_gracefully(self) -> None:
        """The local side closes: end the connection once everything queued is written (a
        WebSocket says goodbye first)."""
        self.close_after_writes()

    async def drain(self) -> None:
        """Wait while the transport has paused writing (its buffer over the high water)."""
        while self._write_paused and self.error is None:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
        if self.error is not None and (self.transport is None or self.transport.is_closing()):
            raise fresh_error(self.error)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


#: The most bytes the receive scratch buffer grows to; larger messages get a buffer of their own.
SCRATCH_BYTES = 256 * 1024
#: Reading pauses while more than this many received bytes wait for ``recv``.
RECV_QUEUE_BYTES = 16 * 1024 * 1024


class StreamProtocol(StreamSending, asyncio.BufferedProtocol):
    """Receives framed messages into their own buffers; see the module docstring.

    Args:
        max_message_bytes: the largest message accepted once authenticated.
        admission: on a listener's side, the :class:`Admission` that admits this connection
            when it is accepted (refused: it is closed before anything is read).
        binding: on a listener's side, the channel binding (the listener's certificate's
            binding over TLS, ``b""`` without); ``None`` on a connecting side, which reads it
            off the certificate it receives.
    """

    def __init__(self, max_message_bytes: int, *, admission: Admission | None = None,
                 binding: bytes | None = None) -> None:
        super().__init__()
        self.max_message_bytes = max_message_bytes
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
        self.placer: Placer | None = None
        self._queued = 0
        self._reading_paused = False
        self._recv_waiter: asyncio.Future[None] | None = None
        self.lost = asyncio.get_running_loop().create_future()

    @abc.abstractmethod
    def parse(self, view: memoryview) -> int:
        """Consume one frame's header (and its payload when it is all in ``view``).

        Returns the bytes consumed; 0 when more bytes are needed. To receive a payload
        directly, call :meth:`expect_payload` and return the header's length plus what of the
        payload ``view`` holds.
        """

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
        """Lift the pre-authentication limits: tell the admission ticket, let the scratch
        buffer grow (see :meth:`_compact`), grow the socket's kernel buffers, read on.
        Idempotent."""
        if self._budget is None:
            return
        self._budget = None
        if self._ticket is not None:
            self._ticket.authenticated()
        if self.transport is None or self.error is not None:
            return  # closed or failing: nothing more will be read
        transport = self.transport
        enlarge_socket_buffers(transport)
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
            self._ticket = self._admission.admit(host_of(peer), self.drop)
            self._admission = None
            if self._ticket is None:  # refused (and logged)
                self.fail(TransportError(f"refused the connection from {self.remote}: too "
                                         "many connections"))
                transport.abort()
                return
        if self.binding is None:  # a connecting side: the listener's certificate, if any
            self.binding = binding_of_peer(transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        set_no_delay(transport)
        self._writer = SocketWriter.for_transport(transport, self._write_failed)

    def handed_over(self, transport: asyncio.Transport, ticket: Ticket) -> None:
        """Start on ``transport`` with the admission ``ticket`` a
        :class:`~burncoll.transport.tls_gate.TlsGate` took for the connection before its TLS
        handshake (no second admission): ``connection_made``, then parse what arrived between
        the handshake and now."""
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
            # TLS bytes that follow the handshake before the TLS gate hands the connection
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
        """Move the unparsed bytes to the start; a frame that fills the whole buffer grows it
        (4x, up to :data:`SCRATCH_BYTES`) once authenticated."""
        left = self._end - self._start
        if left == len(self._scratch):
            if self._budget is not None or left >= SCRATCH_BYTES:  # pragma: no cover
                # parse refuses such a frame first (budget, JOIN_BYTES)
                self.protocol_error(ProtocolError("a frame longer than the scratch buffer"))
                return
            scratch = bytearray(min(4 * left, SCRATCH_BYTES))
            scratch[:left] = self._view[self._start:self._end]
            self._scratch, self._view = scratch, memoryview(scratch)
        else:
            self._scratch[:left] = self._view[self._start:self._end]
        self._start, self._end = 0, left

    # -- reading into place ----------------------------------------------------------------------
    def expect_payload(self, size: int, have: memoryview,
                       done: Callable[[memoryview], None], message: bool = True) -> None:
        """Receive a payload of ``size`` bytes, of which ``have`` arrived, into its own buffer;
        ``done(buffer)`` is called once it is complete.

        ``message``: the payload is a whole message. Then :attr:`placer`, when set, may name
        where its bytes go: ``placer(have, size)`` returns ``(head, destination)`` -- the
        message's first ``head`` bytes (all in ``have``) are kept apart and the rest is read
        straight into ``destination`` -- and the message is delivered as a
        :class:`~burncoll.protocol.wire.Placed`.
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

    def stop_placing(self) -> None:
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
        waiter = self._recv_waiter  # inline: once per message
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
        self._wake_drain()

    # -- failure ---------------------------------------------------------------------------------
    def fail(self, error: TransportError) -> None:
        """Record why the connection is unusable (the first reason wins) and wake ``recv``."""
        if self.error is None:
            self.error = error
        self._wake_recv()

    def _wake_recv(self) -> None:
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def protocol_error(self, error: ProtocolError) -> None:
        """The peer broke the framing: fail and drop the connection."""
        self.fail(error)
        self._direct = None
        if self.transport is not None:
            self.transport.abort()

    def detach(self) -> socket.socket:
        """The connection's socket, taken out of the event loop (a duplicate; the transport is
        aborted, the TCP connection lives on in the socket returned, non-blocking): for a
        plain connection whose every received message was taken and every written byte sent.
        :class:`~burncoll.ProtocolError` when the other end sent more than was asked for;
        :class:`~burncoll.TransportError` over TLS or once the connection is gone."""
        transport, writer = self.transport, self._writer
        if transport is None or self.error is not None or writer is None:
            raise TransportError(f"the connection to {self.remote} is gone or encrypted")
        if self._messages or self._start != self._end or self._direct is not None:
            raise ProtocolError(f"{self.remote} sent more than was asked for")
        if writer.pending_bytes:  # pragma: no cover - the caller waited for its sends
            raise TransportError(f"the connection to {self.remote} is still sending")
        try:
            sock: socket.socket = transport.get_extra_info("socket").dup()
        except OSError as exc:  # no descriptor left
            raise TransportError(f"the connection to {self.remote} cannot be taken over: "
                                 f"{exc}") from exc
        sock.setblocking(False)
        transport.abort()
        return sock

    # -- used by the connection -------------------------------------------------------------------
    async def next_message(self) -> Buffer | Placed:
        """The next whole message; raises (a copy of) :attr:`error` once there is none."""
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
