"""One QUIC connection with one bidirectional stream: the flow-control credit this side grants
(:class:`GatedConnection`), its asyncio protocol, and the
:class:`~burncoll.transport.base.Connection` on the stream.

The client opens stream 0 with a 4-byte :data:`PREAMBLE`. Each message is an 8-byte
little-endian length and its bytes, cut back into messages by a
:class:`~burncoll.transport.assembler.MessageAssembler`, which refuses a length over
``max_message_bytes`` before buffering it (:data:`ERR_MESSAGE_TOO_BIG`; a
:class:`~burncoll.ProtocolError` on both ends). Closing sends FIN first (the peer's ``recv``
fails at once), waits up to ``close_timeout`` for the peer's acknowledgement, then closes.
``send`` hands aioquic the whole message (no flow control here).

Credit (RFC 9000 section 4): before authentication a stranger gets :data:`PREAUTH_WINDOW` of
credit for the connection and its one bidirectional stream, and no more (aioquic's doubling
is held back), so a STREAM frame at a large offset cannot make aioquic zero-fill more;
out-of-order CRYPTO data is capped at :data:`MAX_PENDING_CRYPTO` per epoch. Once
authenticated the window is raised to :func:`working_window` at once, then follows what the
application has read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from aioquic._buffer import Buffer as QuicBuffer
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection, QuicConnectionError
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import LENGTH_PREFIX_BYTES
from burncoll.transport.admission import Ticket
from burncoll.transport.assembler import MessageAssembler, MessageTooBig
from burncoll.transport.base import PREAUTH_BYTES, Buffer, Connection, format_address

__all__ = ["MAX_PENDING_CRYPTO", "PREAMBLE", "PREAUTH_WINDOW", "GatedConnection", "QuicProtocol",
           "QuicStreamConnection", "working_window"]


#: Flow-control credit (connection and stream) granted before authentication.
PREAUTH_WINDOW = PREAUTH_BYTES
#: Most out-of-order CRYPTO bytes buffered per epoch (a TLS flight is a few KiB).
MAX_PENDING_CRYPTO = 64 * 1024


def working_window(max_message_bytes: int) -> int:
    """The flow-control credit granted once the other side has authenticated."""
    return max(2 * max_message_bytes, 16 * 1024 * 1024)


class GatedConnection(QuicConnection):
    """A QuicConnection whose receive credit this side decides.

    Before :meth:`open_window` the other side gets only its initial credit (``max_data`` /
    ``max_stream_data``, one bidirectional stream): aioquic doubles a window whenever the peer used
    half of it (sending at a high offset, not delivering data), so a stranger could otherwise make
    it zero-fill a large buffer. After it, the other side may send at most ``window`` bytes beyond
    the last byte ``recv`` has returned (:attr:`unread`: bytes of whole messages not yet returned),
    so a reader that stops reading stops the sender, as TCP's flow control does.
    """

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

    def count_unread(self, change: int) -> bool:
        """Messages were delivered to the inbox (``change`` > 0) or read from it (< 0);
        whether to announce the credit at once (a read freed a large part of the window: the
        sender may be waiting for it)."""
        before = self.unread
        self.unread = max(before + change, 0)
        return change < 0 and self.window_open and before >= self.window // 2

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
            raise QuicConnectionError(error_code=QuicErrorCode.CRYPTO_BUFFER_EXCEEDED,
                                      frame_type=frame_type,
                                      reason_phrase="too much crypto buffering")
        super()._handle_crypto_frame(context, frame_type, buf)


#: Sent by the client to open the stream; a listener drops a connection without it.
PREAMBLE = b"BCQ\x01"
#: Application error codes (stream resets and connection closes).
ERR_NO_ERROR = 0
ERR_MESSAGE_TOO_BIG = 0x109
ERR_PROTOCOL = 0x10A
#: The listener dropped the connection (evicted, refused, or not authenticated in time).
ERR_DROPPED = 0x10B
_ping_ids = itertools.count(1)


class QuicStreamConnection(Connection):
    """A :class:`Connection` over one QUIC stream; see the module docstring for the framing
    and for what holds before :meth:`authenticated`."""

    def __init__(self, protocol: QuicProtocol, stream_id: int, remote: str,
                 max_message_bytes: int, close_timeout: float, preamble: bytes = b"", *,
                 binding: bytes = b"") -> None:
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
        """Messages were delivered (``change`` > 0) or read: the credit follows, announced at
        once when the read freed a large part of it (:meth:`GatedConnection.count_unread`)."""
        quic = self._protocol._quic
        if isinstance(quic, GatedConnection) and quic.count_unread(change):
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


class QuicProtocol(QuicConnectionProtocol):
    """One QUIC connection: routes its events to its :class:`QuicStreamConnection`. On a listener it
    also holds the connection's admission ``ticket`` and a ``forget`` callback that makes the server
    drop every reference to it (see :meth:`drop`)."""

    def __init__(self, quic: QuicConnection, *, owns_transport: bool, keepalive: float,
                 on_stream: Callable[[QuicProtocol], QuicStreamConnection] | None = None) -> None:
        super().__init__(quic)
        self.connection: QuicStreamConnection | None = None
        self.handshake: asyncio.Future[None] = self._loop.create_future()
        self.terminated = False
        self.ticket: Ticket | None = None
        #: Listener side: called when the handshake completes; False: the connection is dropped.
        self.admit: Callable[[QuicProtocol], bool] | None = None
        self.forget: Callable[[QuicProtocol], None] | None = None
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
        if isinstance(quic, GatedConnection):
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
        address = self._quic.get_peer_address()  # (None: "?")
        return format_address(address and (str(address[0]).removeprefix("::ffff:"), address[1]))

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
