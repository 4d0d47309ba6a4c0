"""QUIC transport (RFC 9000) on aioquic's asyncio API; always TLS 1.3, ALPN ``burncoll``.

Theory of operation. A :class:`QuicStreamConnection` is one QUIC connection carrying one
bidirectional stream: the client opens it (stream 0) by sending a 4-byte preamble, which also
tells the listener to start its handler. On the stream each message is an 8-byte little-endian
length followed by that many bytes; :class:`MessageAssembler` cuts the stream back into
messages whatever the chunking of the data, and rejects a length over ``max_message_bytes``
before buffering it (:class:`~burncoll.ProtocolError`; the receiver then stops the stream with
code ``ERR_MESSAGE_TOO_BIG`` and the sender's ``recv`` raises ProtocolError too).

Before authentication. Until :meth:`QuicStreamConnection.authenticated` (called on both ends
by :mod:`burncoll.transport.auth` after the challenge-response) the other side is a stranger:

* it gets :data:`~burncoll.transport.base.PREAUTH_BYTES` of flow-control credit, for the
  connection and for its stream, and no more (aioquic would double the credit as it is used:
  that is held back), one bidirectional stream and no unidirectional one. A STREAM frame at a
  large offset therefore cannot make aioquic zero-fill more than that; out-of-order CRYPTO
  data is capped at :data:`MAX_PENDING_CRYPTO` per epoch (aioquic's own cap is 512 KiB);
* the assembler reads at most ``PREAUTH_BYTES`` in total and allocates nothing larger on the
  stranger's word (see :class:`~burncoll.transport.wire.MessageAssembler`).

``authenticated`` then raises both windows to the working one (``2 * max_message_bytes``, at
least 16 MiB) and announces it at once (MAX_DATA, MAX_STREAM_DATA), so throughput after
authentication is what it was without the gate.

A listener defends itself against handshake floods (:class:`_GuardedServer`). Sources are
grouped as :func:`source_of` does (an IPv4 address; an IPv6 /64, what one host or site usually
holds). At most ``max_handshakes_per_source`` handshakes are in progress per source (8: more
than a host running several nodes opens at once; a dropped Initial is retransmitted by its
client) and ``max_handshakes`` in all. A new client must first prove its address with a
stateless Retry (RFC 9000 section 8.1) when its source already has a handshake in progress,
when ``retry_handshakes`` are in progress, or when the global cap is reached: a host cannot
claim slots for addresses it does not hold. When the global cap is reached, a validated
newcomer evicts the oldest handshake of the source holding the most, provided that source
then still holds at least as many as the newcomer's (max-min fairness: one host holding
half-open handshakes cannot lock others out, and sources holding one each do not churn);
otherwise, or over the per-source cap, the Initial is dropped before any
cryptographic work. A handshake not completed within ``min(connect_timeout, HANDSHAKE_SECONDS)``
(:data:`HANDSHAKE_SECONDS` is 3 s: a LAN handshake takes milliseconds, and a few lost packets'
retransmissions fit) is dropped, so a slot held by a silent client is soon free again; and
every connection whose handshake completes passes the listener's
:class:`~burncoll.transport.admission.Admission`
(caps on unauthenticated connections, total and per source host, oldest evicted first; a cap
on all connections, also checked before a handshake starts; the ``preauth_seconds`` deadline,
counted from the end of the handshake). Admitting only completed handshakes keeps a flood of
Initial packets, which never completes one, from evicting a legitimate client that is
authenticating. A dropped connection is sent a CONNECTION_CLOSE (its client
sees a :class:`~burncoll.TransportError` and may retry) and forgotten at once: its state is
released without waiting for QUIC's closing period.

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
import ipaddress
import itertools
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

from aioquic._buffer import Buffer as QuicBuffer
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection, QuicConnectionError
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicHeader,
    QuicPacketType,
    encode_quic_retry,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.retry import QuicRetryTokenHandler
from aioquic.quic.stream import QuicStream
from cryptography.hazmat.primitives.serialization import Encoding

from burncoll.errors import ConfigError, ProtocolError, TransportError
from burncoll.transport.admission import Admission, Ticket, source_group
from burncoll.transport.base import (
    PREAUTH_BYTES,
    PREAUTH_SECONDS,
    Buffer,
    Connection,
    Handler,
    Listener,
    TlsSettings,
    Transport,
)
from burncoll.transport.tls import (
    binding_of_certificate,
    configure_quic_client,
    configure_quic_server,
    listener_binding,
)
from burncoll.transport.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    LENGTH_PREFIX_BYTES,
    MessageAssembler,
    MessageTooBig,
)

__all__ = ["ALPN", "QuicListener", "QuicStreamConnection", "QuicTransport", "source_of"]

logger = logging.getLogger("burncoll.transport")

ALPN = "burncoll"
#: Sent by the client to open the stream; a listener drops a connection without it.
PREAMBLE = b"BCQ\x01"
#: Application error codes (stream resets and connection closes).
ERR_NO_ERROR = 0
ERR_MESSAGE_TOO_BIG = 0x109
ERR_PROTOCOL = 0x10A
#: The listener dropped the connection (evicted, refused, or not authenticated in time).
ERR_DROPPED = 0x10B
#: aioquic writes a STREAM frame's length as a 2-byte varint (at most 16383) and silently
#: truncates longer ones, so a datagram must not carry more: larger ones lose data.
MAX_DATAGRAM_SIZE = 16384
#: Flow-control credit (connection and stream) granted before authentication.
PREAUTH_WINDOW = PREAUTH_BYTES
#: Most out-of-order CRYPTO bytes buffered per epoch (a TLS flight is a few KiB).
MAX_PENDING_CRYPTO = 64 * 1024
#: Default caps of a listener: handshakes in progress, and above how many a Retry is asked.
MAX_HANDSHAKES = 64
RETRY_HANDSHAKES = 16
#: Default cap on a single source's handshakes in progress (see :func:`source_of`).
MAX_HANDSHAKES_PER_SOURCE = 8
#: The longest a listener waits for a handshake to complete (or ``connect_timeout``, if less).
HANDSHAKE_SECONDS = 3.0
_SOCKET_BUFFER = 8 * 1024 * 1024
_HANDLER_GRACE = 1.0
_ping_ids = itertools.count(1)


def working_window(max_message_bytes: int) -> int:
    """The flow-control credit granted once the other side has authenticated."""
    return max(2 * max_message_bytes, 16 * 1024 * 1024)


class _GatedConnection(QuicConnection):
    """A QuicConnection whose receive credit this side decides.

    Before :meth:`open_window` it grants the other side only its initial credit (the
    configuration's ``max_data`` / ``max_stream_data``, one bidirectional stream). aioquic
    doubles a window whenever the peer has used half of it -- using it means sending at a high
    offset, not delivering data -- so without the gate a stranger could raise it step by step
    and make aioquic zero-fill a large buffer.

    After it, the credit follows what the application has *read*: the other side may send at
    most ``window`` bytes beyond the last byte of the messages ``recv`` has returned
    (:attr:`unread` counts the bytes of whole messages not yet returned). A reader that stops
    reading (the data service pausing a member that runs ahead) stops the sender, as TCP's
    flow control does on the stream transports: what waits here is bounded by ``window`` and
    the message in progress. aioquic's own doubling, which follows arrival, is kept out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_open = False
        self.window = 0
        #: Bytes of whole messages delivered to the connection's inbox and not yet read.
        self.unread = 0
        for limit, value in ((self._local_max_streams_bidi, 1), (self._local_max_streams_uni, 0)):
            limit.value = limit.sent = value  # read when the transport parameters are sent

    def open_window(self, window: int) -> None:
        """Raise the connection's and every stream's receive window to ``window``; the next
        packet sent announces it (MAX_DATA, MAX_STREAM_DATA)."""
        self.window_open = True
        self.window = window
        limit = self._local_max_data
        limit.value = max(limit.value, window)
        self._local_max_stream_data_bidi_local = max(self._local_max_stream_data_bidi_local,
                                                     window)
        self._local_max_stream_data_bidi_remote = max(self._local_max_stream_data_bidi_remote,
                                                      window)
        for stream in self._streams.values():
            if stream.max_stream_data_local:  # zero: a stream this side only sends on
                stream.max_stream_data_local = max(stream.max_stream_data_local, window)

    def _credit(self, granted: int, received: int) -> int:
        """The limit to grant once ``received`` bytes arrived: ``window`` beyond what the
        application has read, raised only when less than half of that is left (so that a
        MAX_DATA frame goes out now and then, not in every packet)."""
        read = received - self.unread
        if granted - read >= self.window // 2:
            return granted
        return read + self.window

    def _write_connection_limits(self, builder: QuicPacketBuilder,
                                 space: QuicPacketSpace) -> None:
        if not self.window_open:
            return
        limit = self._local_max_data
        limit.value = self._credit(limit.value, limit.used)
        used, limit.used = limit.used, 0  # aioquic doubles on arrival when used > value / 2
        try:
            super()._write_connection_limits(builder=builder, space=space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace,
                             stream: QuicStream) -> None:
        if not self.window_open:
            return
        receiver = stream.receiver
        if stream.max_stream_data_local:
            stream.max_stream_data_local = self._credit(stream.max_stream_data_local,
                                                        receiver.highest_offset)
        highest, receiver.highest_offset = receiver.highest_offset, 0  # no doubling on arrival
        try:
            super()._write_stream_limits(builder=builder, space=space, stream=stream)
        finally:
            receiver.highest_offset = highest

    def _handle_crypto_frame(self, context: Any, frame_type: int, buf: QuicBuffer) -> None:
        start = buf.tell()
        offset, length = buf.pull_uint_var(), buf.pull_uint_var()
        buf.seek(start)
        stream = self._crypto_streams.get(context.epoch)
        if stream is not None and (
                offset + length - stream.receiver.starting_offset() > MAX_PENDING_CRYPTO):
            raise QuicConnectionError(
                error_code=QuicErrorCode.CRYPTO_BUFFER_EXCEEDED,
                frame_type=frame_type,
                reason_phrase="too much crypto buffering",
            )
        super()._handle_crypto_frame(context, frame_type, buf)


class QuicStreamConnection(Connection):
    """A :class:`Connection` over one QUIC stream; see the module docstring for the framing
    and for what holds before :meth:`authenticated`."""

    def __init__(
        self,
        protocol: _Protocol,
        stream_id: int,
        remote: str,
        max_message_bytes: int,
        close_timeout: float,
        preamble: bytes = b"",
        *,
        binding: bytes = b"",
    ) -> None:
        self.remote = remote
        self._protocol = protocol
        self._stream_id = stream_id
        self._close_timeout = close_timeout
        self._window = working_window(max_message_bytes)
        self._binding = binding
        self._assembler = MessageAssembler(
            max_message_bytes, preamble, preauth_bytes=PREAUTH_BYTES)
        self._inbox: deque[bytearray] = deque()
        self._error: TransportError | None = None
        self._changed = asyncio.Event()
        self._closing: asyncio.Task[None] | None = None

    def authenticated(self) -> None:
        """Lift the pre-authentication limits: the bytes held so far are cut into messages,
        and the working flow-control window is granted and announced at once."""
        if self._assembler.is_authenticated:
            return
        try:
            messages = self._assembler.authenticated()
            self._inbox.extend(messages)
            self._count_unread(sum(len(m) + LENGTH_PREFIX_BYTES for m in messages))
        except ProtocolError as exc:
            self._reject(exc)
            return
        self._changed.set()
        self._protocol.authenticated(self._window)

    def channel_binding(self) -> bytes:
        return self._binding

    # -- called by the protocol --------------------------------------------------------------

    def _on_data(self, data: bytes, end_stream: bool) -> None:
        try:
            messages = self._assembler.feed(data)
        except ProtocolError as exc:
            self._reject(exc)
            return
        if messages:
            self._inbox.extend(messages)
            self._count_unread(sum(len(m) + LENGTH_PREFIX_BYTES for m in messages))
        self._changed.set()  # before authentication: recv cuts the next message itself
        if end_stream:
            cut = " in the middle of a message" if self._assembler.mid_message else ""
            self._fail(TransportError(f"{self.remote} closed the connection{cut}"))

    def _count_unread(self, change: int) -> None:
        """Messages were delivered (``change`` > 0) or read: the credit granted the other
        side follows (see :class:`_GatedConnection`). A read that frees a large part of the
        window announces the new credit at once: the sender may be waiting for it."""
        quic = self._protocol._quic
        if not isinstance(quic, _GatedConnection):
            return
        before = quic.unread
        quic.unread = max(before + change, 0)
        if change < 0 and quic.window_open and before >= quic.window // 2:
            self._protocol.transmit()

    def _reject(self, error: ProtocolError) -> None:
        """The peer's bytes are unacceptable: fail, and reset the stream and the connection."""
        self._fail(error)
        code = ERR_MESSAGE_TOO_BIG if isinstance(error, MessageTooBig) else ERR_PROTOCOL
        self._protocol.abort(self._stream_id, code, str(error))

    def _fail(self, error: TransportError) -> None:
        """Record why the connection is unusable (the first reason wins) and wake ``recv``."""
        if self._error is None:
            self._error = error
        self._changed.set()

    def _next_held(self) -> bytearray | None:
        """Before authentication: the next message cut from the bytes held (see
        :class:`MessageAssembler`); a refused one fails the connection and raises."""
        try:
            return self._assembler.next_held()
        except ProtocolError as exc:
            self._reject(exc)
            raise

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
            if self._closing is None:
                if self._inbox:
                    message = self._inbox.popleft()
                    self._count_unread(-len(message) - LENGTH_PREFIX_BYTES)
                    return message
                held = self._next_held()
                if held is not None:
                    return held
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
    """One QUIC connection: routes its events to its :class:`QuicStreamConnection`.

    On a listener it also holds the connection's admission ``ticket`` and a ``forget``
    callback that makes the server drop every reference to it (see :meth:`drop`).
    """

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
        self.ticket: Ticket | None = None
        #: Listener side: called when the handshake completes; False: the connection is dropped.
        self.admit: Callable[[_Protocol], bool] | None = None
        self.forget: Callable[[_Protocol], None] | None = None
        self._owns_transport = owns_transport
        self._keepalive = keepalive
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._on_stream = on_stream
        self._released = False  # forgotten by the listener: sends nothing, arms no timer

    def quic_event_received(self, event: events.QuicEvent) -> None:
        # Deliberately not calling super(): it would build asyncio.StreamReaders we do not use.
        if self.terminated:
            return  # dropped: what was in the same datagram is of no interest
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
            self._settle_handshake()
            admit, self.admit = self.admit, None
            if admit is not None and not admit(self):
                return
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

    def authenticated(self, window: int) -> None:
        """The other side authenticated: grant it ``window`` of credit, announced at once,
        and take the connection off the listener's unauthenticated list."""
        quic = self._quic
        if isinstance(quic, _GatedConnection):
            quic.open_window(window)
        if self.ticket is not None:
            self.ticket.authenticated()
        self.transmit()

    def start_handshake_deadline(self, seconds: float) -> None:
        """Drop the connection unless its handshake completes within ``seconds``."""
        self._handshake_timer = self._loop.call_later(seconds, self._handshake_expired, seconds)

    def _handshake_expired(self, seconds: float) -> None:
        self._handshake_timer = None
        self.drop(f"handshake not completed within {seconds:g} s")

    def drop(self, reason: str) -> None:
        """Close the connection at once with ``reason`` (the peer is sent a CONNECTION_CLOSE)
        and forget it, without waiting for QUIC's closing period."""
        if self.terminated:
            return
        self._quic.close(error_code=ERR_DROPPED, reason_phrase=reason[:200])
        self.transmit()
        self._terminate(TransportError(f"dropped the connection from {self._remote()}: {reason}"))

    def _terminate(self, error: TransportError) -> None:
        self.terminated = True
        self._settle_handshake()
        if not self.handshake.done():
            self.handshake.set_exception(error)
            self.handshake.exception()  # retrieved here; the connect path re-raises it
        if self.connection is not None:
            self.connection._fail(error)
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
            self._keepalive_timer = None
        if self._owns_transport and self._transport is not None:
            self._transport.close()
        self._closed.set()
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None
        if self.forget is not None:
            self._release()

    def _release(self) -> None:
        """On a listener, once terminated: stop the connection's timer and make the server
        forget it, so that nothing keeps its state alive (no reference cycle either)."""
        forget, self.forget = self.forget, None
        if forget is not None:
            forget(self)
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._connection_id_issued_handler = _ignore
        self._connection_id_retired_handler = _ignore
        self._connection_terminated_handler = _nothing
        self.connection = None
        self._on_stream = None
        streams = getattr(self._quic, "_streams", None)
        if isinstance(streams, dict):
            # aioquic's connection sits in reference cycles of its own (bound methods): free
            # its stream buffers now rather than at the next garbage collection.
            streams.clear()

    def _settle_handshake(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def _arm_keepalive(self) -> None:
        # A method, not a closure calling itself: that would be a reference cycle keeping
        # a dropped connection alive until a garbage collection.
        self._keepalive_timer = self._loop.call_later(self._keepalive, self._ping)

    def _ping(self) -> None:
        if not self.terminated:
            self._quic.send_ping(next(_ping_ids))
            self.transmit()
            self._keepalive_timer = self._loop.call_later(self._keepalive, self._ping)

    def _remote(self) -> str:
        address = self._quic.get_peer_address()
        if address is None:
            return "?"
        host = str(address[0]).removeprefix("::ffff:")
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"

    def transmit(self) -> None:
        # A closed listener socket must not be written to by connections still closing.
        if not self._released and self._transport is not None and not self._transport.is_closing():
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


def _ignore(cid: bytes) -> None:
    return None


def _nothing() -> None:
    return None


def source_of(address: NetworkAddress | None) -> str:
    """The source a listener counts a peer's handshakes against, grouped as the admission
    groups connections (:func:`~burncoll.transport.admission.source_group`: an IPv4 address,
    also when written IPv4-mapped, or the /64 of an IPv6 one). ``"?"`` when the address is
    unknown or unparsable."""
    if address is None:
        return "?"
    host = str(address[0])
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return "?"
    return source_group(host)


class _GuardedServer(QuicServer):
    """aioquic's server, with the new-connection path guarded (see the module docstring):
    caps on handshakes in progress (per source and in all, with eviction of the source holding
    the most), Retry under load and for repeat sources, a handshake deadline, admission."""

    def __init__(
        self,
        *,
        configuration: QuicConfiguration,
        create_protocol: Callable[..., _Protocol],
        admission: Admission,
        max_handshakes: int,
        retry_handshakes: int,
        handshake_timeout: float,
        max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE,
    ) -> None:
        super().__init__(configuration=configuration, create_protocol=create_protocol)
        self.admission = admission
        self.max_handshakes = max_handshakes
        self.retry_handshakes = retry_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.handshake_timeout = handshake_timeout
        #: Connections whose handshake is in progress, oldest first, with their source.
        self.handshaking: dict[_Protocol, str] = {}
        #: Handshakes evicted so far to make room for another source's.
        self.evictions = 0
        self._tokens = QuicRetryTokenHandler()
        self._dropped = 0
        self._logged_at = 0.0

    def in_progress(self, source: str) -> int:
        """How many handshakes ``source`` (as :func:`source_of` names it) has in progress."""
        return sum(1 for s in self.handshaking.values() if s == source)

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        data = cast(bytes, data)
        header = self._new_connection(data)
        if header is None:
            super().datagram_received(data, addr)  # an existing connection, or stateless
        else:
            self._open(header, data, addr)

    def _new_connection(self, data: bytes) -> QuicHeader | None:
        """The header of ``data`` when it is an Initial packet that would open a connection."""
        if len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            return None
        try:
            header = pull_quic_header(
                QuicBuffer(data=data), host_cid_length=self._configuration.connection_id_length
            )
        except ValueError:
            return None
        if (header.packet_type != QuicPacketType.INITIAL
                or header.version not in self._configuration.supported_versions
                or header.destination_cid in self._protocols):
            return None
        return header

    def _open(self, header: QuicHeader, data: bytes, addr: NetworkAddress) -> None:
        """Screen an Initial packet for a new connection, then open it (or not).

        Checks cost nothing before the Retry token is read (an AES-GCM open); the only state
        created for an unvalidated address is the connection opened while fewer than
        ``retry_handshakes`` are in progress and none from its source."""
        self._prune()
        source = source_of(addr)
        counts = Counter(self.handshaking.values())
        held = counts[source]
        if held >= self.max_handshakes_per_source:
            self._refused(f"{source} has {held} handshakes in progress")
            return
        admission = self.admission
        if admission.connections + len(self.handshaking) >= admission.max_connections:
            self._refused(f"{admission.max_connections} connections are open or opening")
            return
        full = len(self.handshaking) >= self.max_handshakes
        victim: str | None = None
        if full:
            victim = self._victim(counts, held)
            if victim is None:
                self._refused(f"{self.max_handshakes} handshakes are in progress, "
                              "none from a source holding more than its share")
                return
        retry_cid: bytes | None = None
        if header.token:  # the answer to a Retry: the address is validated
            try:
                original_cid = self._tokens.validate_token(
                    address=addr, destination_cid=header.destination_cid, token=header.token,
                    now=self._loop.time())
            except ValueError:
                return
            retry_cid = header.destination_cid
        elif full or held or len(self.handshaking) >= self.retry_handshakes:
            self._send_retry(header, addr)
            return
        else:
            original_cid = header.destination_cid
        if victim is not None:
            self._evict(victim, source)
        quic = _GatedConnection(
            configuration=self._configuration,
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_cid,
        )
        protocol = cast(_Protocol, self._create_protocol(quic))
        self._register(protocol, header.destination_cid, source)
        protocol.datagram_received(data, addr)

    def _prune(self) -> None:
        """Forget handshakes that ended without the server hearing of it (a safety net: the
        protocol normally reports its end through ``admit`` or ``forget``)."""
        for protocol in [p for p in self.handshaking if p.handshake.done() or p.terminated]:
            del self.handshaking[protocol]

    def _victim(self, counts: Counter[str], held: int) -> str | None:
        """The source whose oldest handshake makes room for a newcomer whose source holds
        ``held``: the one holding the most, if that is more than ``held + 1`` (so never the
        newcomer's own, and never one left with fewer than the newcomer would have)."""
        if not counts:
            return None
        source, most = counts.most_common(1)[0]
        return source if most > held + 1 else None

    def _evict(self, victim: str, newcomer: str) -> None:
        """Drop the oldest handshake in progress from ``victim`` (a CONNECTION_CLOSE is sent)."""
        oldest = next(p for p, s in self.handshaking.items() if s == victim)
        self.evictions += 1
        logger.debug("%s: evicted a handshake from %s (%d in progress) for one from %s",
                     self.admission.name, victim, self.in_progress(victim), newcomer)
        oldest.drop(f"evicted: {self.max_handshakes} handshakes in progress, "
                    f"{victim} holding the most")
        self.handshaking.pop(oldest, None)

    def _register(self, protocol: _Protocol, cid: bytes, source: str) -> None:
        """What aioquic's server does for a new connection, plus our bookkeeping."""
        assert self._transport is not None
        protocol.connection_made(self._transport)
        protocol._connection_id_issued_handler = partial(
            self._connection_id_issued, protocol=protocol)
        protocol._connection_id_retired_handler = partial(
            self._connection_id_retired, protocol=protocol)
        protocol._connection_terminated_handler = partial(
            self._connection_terminated, protocol=protocol)
        self._protocols[cid] = protocol
        self._protocols[protocol._quic.host_cid] = protocol
        protocol.admit = self._admit
        protocol.forget = self._forget
        self.handshaking[protocol] = source
        protocol.start_handshake_deadline(self.handshake_timeout)

    def _admit(self, protocol: _Protocol) -> bool:
        """A handshake completed: ask the admission (which may evict an older unauthenticated
        connection, and starts the pre-authentication deadline). Refused: dropped."""
        self.handshaking.pop(protocol, None)
        address = protocol._quic.get_peer_address()
        source = str(address[0]).removeprefix("::ffff:") if address is not None else "?"
        ticket = self.admission.admit(source, protocol.drop)
        if ticket is None:
            protocol.drop(f"refused: {self.admission.max_connections} connections are open")
            return False
        protocol.ticket = ticket
        return True

    def _forget(self, protocol: _Protocol) -> None:
        """Drop every reference the server holds to ``protocol``."""
        self.handshaking.pop(protocol, None)
        for cid in [cid for cid, p in self._protocols.items() if p is protocol]:
            del self._protocols[cid]

    def _send_retry(self, header: QuicHeader, addr: NetworkAddress) -> None:
        assert self._transport is not None and header.version is not None
        source_cid = os.urandom(8)
        token = self._tokens.create_token(
            address=addr, original_destination_connection_id=header.destination_cid,
            retry_source_connection_id=source_cid, now=self._loop.time())
        self._transport.sendto(
            encode_quic_retry(
                version=header.version, source_cid=source_cid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid, retry_token=token),
            addr,
        )

    def _refused(self, why: str) -> None:
        """Count a dropped Initial packet; log at most one line a second."""
        self._dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            logger.warning("%s: dropped %d Initial packet(s) for new connections: %s",
                           self.admission.name, self._dropped, why)
            self._logged_at, self._dropped = now, 0


class QuicListener(Listener):
    """A bound UDP socket accepting QUIC connections; one handler task per connection."""

    def __init__(self, transport: QuicTransport, handler: Handler, binding: bytes) -> None:
        self.host, self.port = "", 0
        self._transport = transport
        self._handler = handler
        self._binding = binding
        self._udp: asyncio.DatagramTransport | None = None
        self._server: _GuardedServer | None = None
        self._connections: set[QuicStreamConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Task[None] | None = None

    def _bind(self, udp: asyncio.DatagramTransport, server: _GuardedServer) -> None:
        self._udp, self._server = udp, server
        sockname = udp.get_extra_info("sockname")
        self.host, self.port = sockname[0], sockname[1]
        server.admission.name = f"QUIC listener {self.host}:{self.port}"

    @property
    def admission(self) -> Admission:
        """The caps on this listener's connections (see :mod:`burncoll.transport.admission`)."""
        assert self._server is not None
        return self._server.admission

    @property
    def tracked(self) -> int:
        """Connection ids the server still routes (aioquic's ``_protocols``): every dropped or
        closed connection's are removed, so this returns to zero when all are gone."""
        return len(self._server._protocols) if self._server is not None else 0

    def _accept(self, protocol: _Protocol) -> QuicStreamConnection:
        """Called on a new connection's first stream data: start its handler."""
        conn = QuicStreamConnection(
            protocol,
            0,
            protocol._remote(),
            self._transport.max_message_bytes,
            self._transport.close_timeout,
            preamble=PREAMBLE,
            binding=self._binding,
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
        assert self._server is not None
        self._server.admission.close()  # drops the unauthenticated connections
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
        connect_timeout: seconds for the QUIC handshake. A listener drops a handshake not
            completed within ``min(connect_timeout, HANDSHAKE_SECONDS)`` (3 s): a slot held by a
            client that never finishes is soon free again.
        close_timeout: seconds ``close`` waits for the peer to acknowledge what was sent.
        idle_timeout: seconds of silence after which a peer is declared gone.
        preauth_seconds: a listener drops a connection not authenticated this long after
            its first packet.
        max_handshakes: handshakes in progress at a listener; beyond it a new connection from
            a validated address evicts the oldest handshake of the source holding the most
            (when that source holds more than the newcomer's would), or is dropped unread.
        max_handshakes_per_source: handshakes in progress per source (an IPv4 address, an
            IPv6 /64) beyond which that source's Initial packets are dropped unread.
        retry_handshakes: handshakes in progress beyond which a new client must validate its
            address with a Retry first.
        max_connections, max_pending, max_pending_per_source: a listener's
            :class:`~burncoll.transport.admission.Admission` caps.
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
        preauth_seconds: float = PREAUTH_SECONDS,
        max_handshakes: int = MAX_HANDSHAKES,
        retry_handshakes: int = RETRY_HANDSHAKES,
        max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE,
        max_connections: int = 1024,
        max_pending: int = 64,
        max_pending_per_source: int = 16,
    ) -> None:
        if not 1200 <= max_datagram_size <= MAX_DATAGRAM_SIZE:
            raise ConfigError(
                f"max_datagram_size must be in [1200, {MAX_DATAGRAM_SIZE}], not {max_datagram_size}"
            )
        if not 0 <= retry_handshakes <= max_handshakes or max_handshakes < 1:
            raise ConfigError(
                "QUIC needs 0 <= retry_handshakes <= max_handshakes and max_handshakes >= 1, "
                f"not retry_handshakes={retry_handshakes}, max_handshakes={max_handshakes}"
            )
        if not 1 <= max_handshakes_per_source <= max_handshakes:
            raise ConfigError(
                "QUIC needs 1 <= max_handshakes_per_source <= max_handshakes, not "
                f"max_handshakes_per_source={max_handshakes_per_source}, "
                f"max_handshakes={max_handshakes}"
            )
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.max_datagram_size = max_datagram_size
        self.congestion_control = congestion_control
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.idle_timeout = idle_timeout
        self.preauth_seconds = preauth_seconds
        self.max_handshakes = max_handshakes
        self.retry_handshakes = retry_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source

    def _configuration(self, is_client: bool) -> QuicConfiguration:
        # The initial credit is the pre-authentication one; authenticated() opens the window.
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            congestion_control_algorithm=self.congestion_control,
            idle_timeout=self.idle_timeout,
            max_datagram_size=self.max_datagram_size,
            max_data=PREAUTH_WINDOW,
            max_stream_data=PREAUTH_WINDOW,
        )

    def _protocol_factory(self, **kwargs: Any) -> Callable[..., _Protocol]:
        def create(quic: QuicConnection, stream_handler: Any = None) -> _Protocol:
            return _Protocol(quic, keepalive=self.idle_timeout / 3, **kwargs)

        return create

    async def listen(self, host: str, port: int, handler: Handler) -> QuicListener:
        configuration = self._configuration(is_client=False)
        configure_quic_server(configuration, self.tls, host)
        listener = QuicListener(self, handler, listener_binding(self.tls, host))
        create_protocol = self._protocol_factory(owns_transport=False, on_stream=listener._accept)
        admission = Admission(
            max_pending=self.max_pending, max_pending_per_source=self.max_pending_per_source,
            max_connections=self.max_connections, preauth_seconds=self.preauth_seconds,
            name=f"QUIC listener {host}:{port}")
        loop = asyncio.get_running_loop()
        try:
            udp, server = await loop.create_datagram_endpoint(
                lambda: _GuardedServer(
                    configuration=configuration, create_protocol=create_protocol,
                    admission=admission, max_handshakes=self.max_handshakes,
                    retry_handshakes=self.retry_handshakes,
                    max_handshakes_per_source=self.max_handshakes_per_source,
                    handshake_timeout=min(self.connect_timeout, HANDSHAKE_SECONDS)),
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
            quic = _GatedConnection(configuration=configuration)
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
            binding = _peer_binding(quic, where)
        except (OSError, TimeoutError, TransportError) as exc:
            if protocol is not None:
                await protocol.shutdown(0)
            detail = "no answer" if isinstance(exc, TimeoutError) else str(exc)
            raise TransportError(f"cannot connect to {where} over QUIC: {detail}") from exc
        stream_id = quic.get_next_available_stream_id()
        conn = QuicStreamConnection(
            protocol, stream_id, where, self.max_message_bytes, self.close_timeout,
            binding=binding,
        )
        protocol.connection = conn
        quic.send_stream_data(stream_id, PREAMBLE)
        protocol.transmit()
        return conn


def _peer_binding(quic: QuicConnection, where: str) -> bytes:
    """The channel binding of the certificate the listener presented in the handshake."""
    certificate = getattr(quic.tls, "_peer_certificate", None)  # aioquic: no public accessor
    if certificate is None:
        raise TransportError(f"{where} presented no certificate in the QUIC handshake")
    return binding_of_certificate(certificate.public_bytes(Encoding.DER))


def _grow_socket_buffers(udp: asyncio.BaseTransport) -> None:
    """Ask for large UDP buffers (the kernel caps them): bursts of big datagrams fit."""
    sock = udp.get_extra_info("socket")
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
