"""QUIC flow-control credit: what a peer may send, decided by this side (RFC 9000 section 4).

Before authentication a stranger gets :data:`PREAUTH_WINDOW` of credit for the connection and
its one bidirectional stream, and no more (aioquic's doubling is held back), so a STREAM frame
at a large offset cannot make aioquic zero-fill more; out-of-order CRYPTO data is capped at
:data:`MAX_PENDING_CRYPTO` per epoch. Once authenticated the window is raised to
:func:`working_window` at once, then follows what the application has read
(:class:`GatedConnection`).
"""

from __future__ import annotations

from typing import Any

from aioquic._buffer import Buffer as QuicBuffer
from aioquic.quic.connection import QuicConnection, QuicConnectionError
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

from burncoll.transport.base import PREAUTH_BYTES

__all__ = ["MAX_PENDING_CRYPTO", "PREAUTH_WINDOW", "GatedConnection", "working_window"]

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
