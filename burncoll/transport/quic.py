"""QUIC transport (RFC 9000) on aioquic's asyncio API; always TLS 1.3, ALPN ``burncoll``.

Theory of operation. A :class:`QuicStreamConnection` is one QUIC connection carrying one
bidirectional stream: the client opens it (stream 0) by sending a 4-byte preamble, which also
tells the listener to start its handler. On the stream each message is an 8-byte little-endian
length followed by that many bytes; :class:`MessageAssembler` cuts the stream back into
messages whatever the chunking of the data, and rejects a length over ``max_message_bytes``
before buffering it (:class:`~burncoll.ProtocolError`; the receiver then stops the stream with
code ``ERR_MESSAGE_TOO_BIG`` and the sender's ``recv`` raises ProtocolError too).

Closing sends the stream's FIN first, so the peer's ``recv`` fails at once instead of after
QUIC's closing period, then waits (up to ``close_timeout``) for the peer to acknowledge what
was sent, then closes the QUIC connection. A peer that vanishes without a word is noticed
after ``idle_timeout``; pings every ``idle_timeout / 3`` keep a quiet but live connection
open. A client's UDP socket is connected, so on a LAN a dead peer's ICMP "port unreachable"
fails the connection (and a connect to a port nobody listens on) at once.

Throughput: aioquic's defaults (1200-byte datagrams, 1 MiB flow-control windows) give about
30 MB/s. Datagrams of ``max_datagram_size`` (16 KiB by default, the most aioquic 1.x handles: IP
fragments them on a 1500-byte-MTU network, which works on a LAN; lower it where fragments are
dropped), windows of
``2 * max_message_bytes`` and larger UDP socket buffers lift that several times over.
Sends are not flow-controlled: ``send`` hands the whole message to aioquic, which keeps it
until the peer acknowledges it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from burncoll.errors import ConfigError, ProtocolError, TransportError
from burncoll.transport.base import Buffer, Connection, Handler, Listener, TlsSettings, Transport
from burncoll.transport.tls import configure_quic_client, configure_quic_server
from burncoll.transport.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    LENGTH_PREFIX_BYTES,
    MessageAssembler,
    MessageTooBig,
)

__all__ = ["ALPN", "QuicListener", "QuicStreamConnection", "QuicTransport"]

logger = logging.getLogger("burncoll.transport")

ALPN = "burncoll"
#: Sent by the client to open the stream; a listener drops a connection without it.
PREAMBLE = b"BCQ\x01"
#: Application error codes (stream resets and connection closes).
ERR_NO_ERROR = 0
ERR_MESSAGE_TOO_BIG = 0x109
ERR_PROTOCOL = 0x10A
#: aioquic writes a STREAM frame's length as a 2-byte varint (at most 16383) and silently
#: truncates longer ones, so a datagram must not carry more: larger ones lose data.
MAX_DATAGRAM_SIZE = 16384
_SOCKET_BUFFER = 8 * 1024 * 1024
_HANDLER_GRACE = 1.0
_ping_ids = itertools.count(1)


class QuicStreamConnection(Connection):
    """A :class:`Connection` over one QUIC stream; see the module docstring for the framing."""

    def __init__(
        self,
        protocol: _Protocol,
        stream_id: int,
        remote: str,
        max_message_bytes: int,
        close_timeout: float,
        preamble: bytes = b"",
    ) -> None:
        self.remote = remote
        self._protocol = protocol
        self._stream_id = stream_id
        self._close_timeout = close_timeout
        self._max_message_bytes = max_message_bytes
        self._assembler = MessageAssembler(max_message_bytes, preamble)
        self._inbox: deque[bytearray] = deque()
        self._error: TransportError | None = None
        self._changed = asyncio.Event()
        self._closing: asyncio.Task[None] | None = None

    def limit_incoming(self, max_bytes: int | None) -> None:
        self._assembler.max_message_bytes = (
            max_bytes if max_bytes is not None else self._max_message_bytes)

    # -- called by the protocol --------------------------------------------------------------

    def _on_data(self, data: bytes, end_stream: bool) -> None:
        try:
            messages = self._assembler.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            code = ERR_MESSAGE_TOO_BIG if isinstance(exc, MessageTooBig) else ERR_PROTOCOL
            self._protocol.abort(self._stream_id, code, str(exc))
            return
        if messages:
            self._inbox.extend(messages)
            self._changed.set()
        if end_stream:
            cut = " in the middle of a message" if self._assembler.mid_message else ""
            self._fail(TransportError(f"{self.remote} closed the connection{cut}"))

    def _fail(self, error: TransportError) -> None:
        """Record why the connection is unusable (the first reason wins) and wake ``recv``."""
        if self._error is None:
            self._error = error
        self._changed.set()

    # -- Connection ---------------------------------------------------------------------------

    async def send(self, parts: Sequence[Buffer]) -> None:
        if self._error is not None:
            raise type(self._error)(str(self._error))
        views = [memoryview(p) for p in parts]
        views = [v if v.c_contiguous else memoryview(v.tobytes()) for v in views]
        total = sum(v.nbytes for v in views)
        quic = self._protocol._quic
        try:
            # No await in between: concurrent sends never interleave.
            quic.send_stream_data(self._stream_id, total.to_bytes(LENGTH_PREFIX_BYTES, "little"))
            for view in views:
                if view.nbytes:
                    # aioquic annotates bytes but only appends the data to a bytearray:
                    # passing the view saves copying the payload once more.
                    quic.send_stream_data(self._stream_id, cast(bytes, view.cast("B")))
        except (ValueError, RuntimeError) as exc:
            raise TransportError(f"sending to {self.remote} failed: {exc}") from exc
        self._protocol.transmit()

    async def recv(self) -> Buffer:
        while True:
            if self._inbox and self._closing is None:
                return self._inbox.popleft()
            if self._error is not None:
                raise type(self._error)(str(self._error))
            self._changed.clear()
            await self._changed.wait()

    async def close(self) -> None:
        if self._closing is None:
            self._fail(TransportError(f"the connection to {self.remote} was closed"))
            self._inbox.clear()
            self._closing = asyncio.create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        protocol = self._protocol
        with contextlib.suppress(ValueError, RuntimeError):  # already finished or reset
            protocol._quic.send_stream_data(self._stream_id, b"", end_stream=True)
        protocol.transmit()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._close_timeout):
                while protocol.usable and not protocol.stream_finished(self._stream_id):
                    await asyncio.sleep(0.005)
        await protocol.shutdown(self._close_timeout)


class _Protocol(QuicConnectionProtocol):
    """One QUIC connection: routes its events to its :class:`QuicStreamConnection`."""

    def __init__(
        self,
        quic: QuicConnection,
        *,
        owns_transport: bool,
        keepalive: float,
        on_stream: Callable[[_Protocol], QuicStreamConnection] | None = None,
    ) -> None:
        super().__init__(quic)
        self.connection: QuicStreamConnection | None = None
        self.handshake: asyncio.Future[None] = self._loop.create_future()
        self.terminated = False
        self._owns_transport = owns_transport
        self._keepalive = keepalive
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._on_stream = on_stream

    def quic_event_received(self, event: events.QuicEvent) -> None:
        # Deliberately not calling super(): it would build asyncio.StreamReaders we do not use.
        if isinstance(event, events.StreamDataReceived):
            if self.connection is None and self._on_stream is not None and event.stream_id == 0:
                self.connection = self._on_stream(self)
            if self.connection is None or event.stream_id != self.connection._stream_id:
                self.abort(None, ERR_PROTOCOL, f"unexpected stream {event.stream_id}")
                return
            self.connection._on_data(event.data, event.end_stream)
        elif isinstance(event, events.StreamReset | events.StopSendingReceived):
            if event.error_code == ERR_MESSAGE_TOO_BIG:
                error: TransportError = ProtocolError(
                    f"{self._remote()} rejected a message over its size limit"
                )
            else:
                error = TransportError(f"{self._remote()} reset the stream")
            if self.connection is not None:
                self.connection._fail(error)
        elif isinstance(event, events.HandshakeCompleted):
            if not self.handshake.done():
                self.handshake.set_result(None)
            self._arm_keepalive()
        elif isinstance(event, events.ConnectionTerminated):
            reason = event.reason_phrase or f"code {event.error_code:#x}"
            self._terminate(TransportError(f"QUIC connection to {self._remote()} ended: {reason}"))

    def error_received(self, exc: Exception) -> None:
        # ICMP errors reach a connected (client) socket: the peer's port is closed.
        if isinstance(exc, ConnectionRefusedError):
            self._terminate(TransportError(f"{self._remote()} refused the connection: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        # Our own socket closed (a client's, or the listener's): nothing more can arrive.
        self._terminate(TransportError(f"the UDP socket for {self._remote()} closed"))

    @property
    def usable(self) -> bool:
        """Whether the connection can still exchange packets."""
        udp = self._transport
        return not self.terminated and udp is not None and not udp.is_closing()

    def _terminate(self, error: TransportError) -> None:
        self.terminated = True
        if not self.handshake.done():
            self.handshake.set_exception(error)
            self.handshake.exception()  # retrieved here; the connect path re-raises it
        if self.connection is not None:
            self.connection._fail(error)
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
        if self._owns_transport and self._transport is not None:
            self._transport.close()
        self._closed.set()

    def _arm_keepalive(self) -> None:
        def ping() -> None:
            if not self.terminated:
                self._quic.send_ping(next(_ping_ids))
                self.transmit()
                self._keepalive_timer = self._loop.call_later(self._keepalive, ping)

        self._keepalive_timer = self._loop.call_later(self._keepalive, ping)

    def _remote(self) -> str:
        address = self._quic.get_peer_address()
        if address is None:
            return "?"
        host = str(address[0]).removeprefix("::ffff:")
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"

    def transmit(self) -> None:
        # A closed listener socket must not be written to by connections still closing.
        if self._transport is not None and not self._transport.is_closing():
            super().transmit()

    def stream_finished(self, stream_id: int) -> bool:
        """Whether the peer acknowledged every byte and the FIN sent on ``stream_id``."""
        streams = getattr(self._quic, "_streams", None)  # aioquic has no public accessor
        stream = streams.get(stream_id) if isinstance(streams, dict) else None
        return stream is None or bool(getattr(stream.sender, "is_finished", True))

    def abort(self, stream_id: int | None, code: int, reason: str) -> None:
        """Reset ``stream_id`` (when given) with ``code`` and close the connection."""
        if stream_id is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                self._quic.stop_stream(stream_id, code)
                self._quic.reset_stream(stream_id, code)
            self.transmit()  # the reset leaves before the CONNECTION_CLOSE
        self._quic.close(error_code=code, reason_phrase=reason[:200])
        self.transmit()

    async def shutdown(self, timeout: float) -> None:
        """Close the QUIC connection and wait (up to ``timeout``) for its closing period."""
        if self.usable:
            self._quic.close(error_code=ERR_NO_ERROR)
            self.transmit()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._closed.wait()
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
        if self._owns_transport:
            # The socket is ours alone: stop the connection's timers and release it. (On a
            # listener the closing period runs out and the server forgets the connection.)
            self.terminated = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._transport is not None:
                self._transport.close()


class QuicListener(Listener):
    """A bound UDP socket accepting QUIC connections; one handler task per connection."""

    def __init__(self, transport: QuicTransport, handler: Handler) -> None:
        self.host, self.port = "", 0
        self._transport = transport
        self._handler = handler
        self._udp: asyncio.DatagramTransport | None = None
        self._server: Any = None
        self._connections: set[QuicStreamConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Task[None] | None = None

    def _bind(self, udp: asyncio.DatagramTransport, server: Any) -> None:
        self._udp, self._server = udp, server
        sockname = udp.get_extra_info("sockname")
        self.host, self.port = sockname[0], sockname[1]

    def _accept(self, protocol: _Protocol) -> QuicStreamConnection:
        """Called on a new connection's first stream data: start its handler."""
        conn = QuicStreamConnection(
            protocol,
            0,
            protocol._remote(),
            self._transport.max_message_bytes,
            self._transport.close_timeout,
            preamble=PREAMBLE,
        )
        if self._closing is not None:
            conn._fail(TransportError("the listener is closing"))
            protocol.abort(None, ERR_NO_ERROR, "listener closing")
            return conn
        self._connections.add(conn)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    async def _serve(self, conn: QuicStreamConnection) -> None:
        try:
            await self._handler(conn)
        except TransportError as exc:
            logger.debug("connection from %s ended: %s", conn.remote, exc)
        except Exception:
            logger.exception("handler for the connection from %s failed", conn.remote)
        finally:
            self._connections.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._server is None:
            return
        if self._closing is None:
            self._closing = asyncio.create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=_HANDLER_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        self._server.close()


class QuicTransport(Transport):
    """Listen and connect with QUIC.

    Args:
        tls: certificates as described in :mod:`burncoll.transport.tls`; ``None`` means an
            ephemeral self-signed certificate that clients do not verify.
        max_message_bytes: the largest message this side accepts.
        max_datagram_size: the largest UDP payload sent: 1200 (aioquic's default) to
            :data:`MAX_DATAGRAM_SIZE`.
        congestion_control: ``"reno"`` or ``"cubic"``.
        connect_timeout: seconds for the QUIC handshake.
        close_timeout: seconds ``close`` waits for the peer to acknowledge what was sent.
        idle_timeout: seconds of silence after which a peer is declared gone.
    """

    name = "quic"

    def __init__(
        self,
        *,
        tls: TlsSettings | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_datagram_size: int = 16384,
        congestion_control: str = "reno",
        connect_timeout: float = 10.0,
        close_timeout: float = 2.0,
        idle_timeout: float = 30.0,
    ) -> None:
        if not 1200 <= max_datagram_size <= MAX_DATAGRAM_SIZE:
            raise ConfigError(
                f"max_datagram_size must be in [1200, {MAX_DATAGRAM_SIZE}], not {max_datagram_size}"
            )
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.max_datagram_size = max_datagram_size
        self.congestion_control = congestion_control
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.idle_timeout = idle_timeout

    def _configuration(self, is_client: bool) -> QuicConfiguration:
        window = max(2 * self.max_message_bytes, 16 * 1024 * 1024)
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            congestion_control_algorithm=self.congestion_control,
            idle_timeout=self.idle_timeout,
            max_datagram_size=self.max_datagram_size,
            max_data=window,
            max_stream_data=window,
        )

    def _protocol_factory(self, **kwargs: Any) -> Callable[..., _Protocol]:
        def create(quic: QuicConnection, stream_handler: Any = None) -> _Protocol:
            return _Protocol(quic, keepalive=self.idle_timeout / 3, **kwargs)

        return create

    async def listen(self, host: str, port: int, handler: Handler) -> QuicListener:
        configuration = self._configuration(is_client=False)
        configure_quic_server(configuration, self.tls, host)
        listener = QuicListener(self, handler)
        create_protocol = self._protocol_factory(owns_transport=False, on_stream=listener._accept)
        loop = asyncio.get_running_loop()
        try:
            udp, server = await loop.create_datagram_endpoint(
                lambda: QuicServer(configuration=configuration, create_protocol=create_protocol),
                local_addr=(host, port),
            )
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise TransportError(f"cannot listen on {host}:{port} (UDP): {reason}") from exc
        _grow_socket_buffers(udp)
        listener._bind(udp, server)
        return listener

    async def connect(self, host: str, port: int) -> QuicStreamConnection:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        configuration = self._configuration(is_client=True)
        configuration.server_name = host
        configure_quic_client(configuration, self.tls)
        loop = asyncio.get_running_loop()
        protocol: _Protocol | None = None
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            family, address = infos[0][0], cast(tuple[str, int], infos[0][4])
            quic = QuicConnection(configuration=configuration)
            create_protocol = self._protocol_factory(owns_transport=True)
            udp, protocol = await loop.create_datagram_endpoint(
                lambda: create_protocol(quic),
                remote_addr=address,
                family=family,
            )
            _grow_socket_buffers(udp)
            protocol.connect(address)
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.shield(protocol.handshake)
        except (OSError, TimeoutError, TransportError) as exc:
            if protocol is not None:
                await protocol.shutdown(0)
            detail = "no answer" if isinstance(exc, TimeoutError) else str(exc)
            raise TransportError(f"cannot connect to {where} over QUIC: {detail}") from exc
        stream_id = quic.get_next_available_stream_id()
        conn = QuicStreamConnection(
            protocol, stream_id, where, self.max_message_bytes, self.close_timeout
        )
        protocol.connection = conn
        quic.send_stream_data(stream_id, PREAMBLE)
        protocol.transmit()
        return conn


def _grow_socket_buffers(udp: asyncio.BaseTransport) -> None:
    """Ask for large UDP buffers (the kernel caps them): bursts of big datagrams fit."""
    sock = udp.get_extra_info("socket")
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
