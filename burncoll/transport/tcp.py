"""Plain TCP transport, and the fast message core that the WebSocket transport shares.

Wire: the client opens with an 8-byte preamble (:data:`PREAMBLE`); after it, each message is
an 8-byte little-endian length (:data:`~burncoll.transport.wire.LENGTH_PREFIX_BYTES`) followed by
that many bytes, in both directions. Authentication (:mod:`burncoll.transport.auth`) runs above
it, as on every transport. No TLS: choose ``websocket`` with TLS settings (wss) to encrypt.

The core, :class:`StreamProtocol`, is an :class:`asyncio.BufferedProtocol` that avoids copying
array bytes:

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
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.base import (
    Buffer,
    Connection,
    Handler,
    Listener,
    Transport,
    byte_view,
    format_address,
)
from burncoll.transport.wire import DEFAULT_MAX_MESSAGE_BYTES, LENGTH_PREFIX_BYTES, Placed
from burncoll.transport.writer import SocketWriter

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

#: The first bytes a TCP client sends: a listener drops a connection that opens otherwise.
PREAMBLE = b"BCTCP\x00\x01\n"
#: Bytes of the receive scratch buffer; larger messages get a buffer of their own.
SCRATCH_BYTES = 256 * 1024
#: Messages up to this size are joined with their header into one write.
JOIN_BYTES = 64 * 1024
#: ``send`` waits while more than this many bytes wait in the transport's buffer.
WRITE_HIGH_WATER = 16 * 1024 * 1024
#: Reading pauses while more than this many received bytes wait for ``recv``.
RECV_QUEUE_BYTES = 256 * 1024 * 1024
#: Socket buffer sizes asked of the kernel (it may grant less).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: How long ``Listener.close`` lets handlers finish before cancelling them.
HANDLER_GRACE = 1.0




def _tune_socket(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option, value in ((socket.SO_SNDBUF, SOCKET_BUFFER_BYTES),
                          (socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)):
        with contextlib.suppress(OSError):  # the kernel's defaults then
            sock.setsockopt(socket.SOL_SOCKET, option, value)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StreamProtocol(asyncio.BufferedProtocol):
    """Receives framed messages into their own buffers; see the module docstring."""

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.transport: asyncio.Transport | None = None
        self.remote = "?"
        self._scratch = bytearray(SCRATCH_BYTES)
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

    # -- asyncio callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.remote = format_address(transport.get_extra_info("peername"))
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        _tune_socket(transport)
        self._writer = SocketWriter.for_transport(transport, self._write_failed)

    def _write_failed(self, exc: OSError) -> None:
        self.fail(TransportError(f"sending to {self.remote} failed: {exc}"))
        if self.transport is not None:
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_filled:]
        if self._end == len(self._scratch):
            self._compact()
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
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
        try:
            while self._direct is None and self._start < self._end and self.error is None:
                used = self.parse(self._view[self._start:self._end])
                if used == 0:
                    break
                self._start += used
        except ProtocolError as exc:
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
        if self._writer is not None:
            assert self.error is not None
            self._writer.close(self.error)
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
        while not self._messages:
            if self.error is not None:
                raise self.error
            self._recv_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._recv_waiter
            finally:
                self._recv_waiter = None
        message = self._messages.popleft()
        self._queued -= len(message)
        if self._reading_paused and self._queued <= RECV_QUEUE_BYTES // 2 and self.transport:
            self._reading_paused = False
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
        if self.error is not None or transport is None or transport.is_closing():
            raise self.error or TransportError(f"connection to {self.remote} is closed")
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
        if self.error is not None and self.transport is not None and self.transport.is_closing():
            raise self.error


class StreamConnection(Connection):
    """A :class:`Connection` over a :class:`StreamProtocol`."""

    def __init__(self, protocol: StreamProtocol, close_timeout: float = 2.0) -> None:
        self._protocol = protocol
        self.remote = protocol.remote
        self.close_timeout = close_timeout
        self._closing = False
        self._max_message_bytes = protocol.max_message_bytes

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

    def limit_incoming(self, max_bytes: int | None) -> None:
        self._protocol.max_message_bytes = (
            max_bytes if max_bytes is not None else self._max_message_bytes)

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
                 preamble_timeout: float = 10.0) -> None:
        super().__init__(max_message_bytes)
        self._await_preamble = server
        self._on_open = on_open
        self._preamble_timeout = preamble_timeout
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._await_preamble:
            self.write_bytes(PREAMBLE)
        else:  # a stranger that says nothing is dropped, not held forever
            self._timer = asyncio.get_running_loop().call_later(
                self._preamble_timeout, self._silent)

    def _silent(self) -> None:
        if self._await_preamble and self.transport is not None:
            logger.warning("dropped a connection from %s: no preamble within %g s",
                           self.remote, self._preamble_timeout)
            self.protocol_error(ProtocolError(
                f"{self.remote} sent no preamble within {self._preamble_timeout:g} s"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
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
            if self._on_open is not None:
                self._on_open(self)
            return len(PREAMBLE)
        if len(view) < LENGTH_PREFIX_BYTES:
            return 0
        size = int.from_bytes(view[:LENGTH_PREFIX_BYTES], "little")
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
    """A bound server; each accepted connection runs the handler in its own task."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._handler_tasks: set[asyncio.Task[Any]] = set()
        self._connections: set[StreamConnection] = set()
        self._closing: asyncio.Task[None] | None = None

    def bind(self, server: asyncio.Server) -> None:
        self._server = server
        sockname = server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

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


async def listen_stream(host: str, port: int, factory: Callable[[], asyncio.BaseProtocol],
                        listener: StreamListener, **kwargs: Any) -> None:
    """Bind ``listener`` to ``host:port`` serving ``factory``; TransportError naming the port."""
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(factory, host, port, **kwargs)
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise TransportError(f"cannot listen on {host}:{port}: {reason}") from exc
    listener.bind(server)


class TcpTransport(Transport):
    """Length-prefixed messages on plain TCP (no TLS); see the module docstring.

    Args:
        max_message_bytes: the largest message this side accepts.
        connect_timeout: seconds for the TCP connect.
        close_timeout: seconds ``close`` waits for the written bytes to leave.
    """

    name = "tcp"

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float = 10.0, close_timeout: float = 2.0) -> None:
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout

    async def listen(self, host: str, port: int, handler: Handler) -> StreamListener:
        listener = StreamListener(host, port)

        def opened(protocol: TcpProtocol) -> None:
            listener.start(StreamConnection(protocol, self.close_timeout), handler)

        await listen_stream(
            host, port, lambda: TcpProtocol(self.max_message_bytes, server=True, on_open=opened,
                                            preamble_timeout=self.connect_timeout),
            listener)
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
