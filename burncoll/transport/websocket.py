"""WebSocket transport (RFC 6455): the ``websockets`` library's handshake, burncoll's framing.

One burncoll message is one binary WebSocket message. The opening handshake is the
``websockets`` library's (its sans-I/O :class:`~websockets.server.ServerProtocol` and
:class:`~websockets.client.ClientProtocol` parse, validate and answer the HTTP Upgrade,
refusals included); the frames after it are read and written by :class:`WebSocketProtocol`
on burncoll's zero-copy stream core (:class:`~burncoll.transport.tcp.StreamProtocol`), because
the library's own connection copies every message several times and reaches a third of what
the socket carries for array-sized messages (``benchmarks/transport_throughput.py``).

The framing follows RFC 6455 section 5:

* One message is sent as one binary frame (FIN set, 16- or 64-bit length). Fragmented messages,
  as other clients send them, are received and joined; text messages are refused (1003).
* **Masking** (section 5.3): a client masks every frame with a fresh random key, as required;
  a server never does. burncoll's nodes send array data as the *server* of the connection (the
  receiving node dials the sending one: :mod:`burncoll.node.data_service`), so array bytes
  travel unmasked and the socket reads them straight into their buffer.
* Control frames: a ping is answered with a pong; a close frame is answered with a close and
  ends the connection; ``close`` sends one (1000) first.
* ``max_message_bytes``: a larger incoming message is refused with close code 1009
  (section 7.4.1); the receiver raises :class:`~burncoll.ProtocolError`, the sender's next
  ``recv`` a :class:`~burncoll.TransportError`. Reserved bits (no extension is negotiated),
  unknown opcodes, and a wrong masking direction close with 1002.
* No compression (permessage-deflate costs far more CPU than array bytes save) and no
  keepalive pings: liveness is the collective's business (every operation has a deadline,
  and a dead peer's kernel resets the TCP connection).
* ``wss``: the same over TLS (:mod:`burncoll.transport.tls`), used whenever the TLS settings
  ask for it (``TlsSettings.wanted``: certificate paths, or ``ephemeral=True`` for an ephemeral
  self-signed certificate that clients do not verify; the token authentication, bound to the
  certificate by :meth:`~burncoll.transport.base.Connection.channel_binding`, then
  authenticates both ends).
* Before authentication (:meth:`~burncoll.transport.base.Connection.authenticated`): the
  pre-authentication byte budget of :mod:`burncoll.transport.tcp` covers the opening handshake
  and every frame (an HTTP head that does not end within it is refused), and a message may come
  in at most :data:`PREAUTH_FRAGMENTS` frames.

A stranger that fails the opening handshake gets the library's HTTP refusal (400/426) and is
dropped with a WARNING naming its address (bounded:
:class:`~burncoll.transport.admission.BoundedLog`); one that says nothing is dropped after
``connect_timeout`` (sooner by its listener's :class:`~burncoll.transport.admission.Admission`
deadline). Over wss a connection is admitted when it is accepted, before its TLS handshake
(:class:`~burncoll.transport.tcp.TlsGate`): the admission's caps and deadline cover the
handshake, which must also end within ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections.abc import Callable
from typing import Any

import numpy as np
from websockets.client import ClientProtocol
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.admission import Admission
from burncoll.transport.base import (
    Buffer,
    Handler,
    TlsSettings,
    Transport,
)
from burncoll.transport.tcp import (
    JOIN_BYTES,
    StreamConnection,
    StreamListener,
    StreamProtocol,
    listen_stream,
    stranger_log,
)
from burncoll.transport.tls import client_ssl_context, listener_binding, server_ssl_context
from burncoll.transport.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.writer import fresh_error

__all__ = [
    "WebSocketConnection",
    "WebSocketListener",
    "WebSocketProtocol",
    "WebSocketTransport",
    "mask_in_place",
]

#: Longest opening handshake (request or response head) accepted.
HANDSHAKE_LIMIT = 16 * 1024
#: Most frames one incoming message may come in (the byte limit alone would let a stranger
#: send millions of empty fragments).
MAX_FRAGMENTS = 4096
#: Most frames one incoming message may come in before the peer authenticates.
PREAUTH_FRAGMENTS = 4

OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
CLOSE_NORMAL, CLOSE_PROTOCOL, CLOSE_UNSUPPORTED, CLOSE_TOO_BIG = 1000, 1002, 1003, 1009


def mask_in_place(data: memoryview, key: bytes) -> None:
    """XOR ``data`` with the 4-byte masking ``key`` repeated (RFC 6455 section 5.3); masking
    and unmasking are the same operation. Eight bytes at a time, through NumPy."""
    array = np.frombuffer(data, dtype=np.uint8)
    words = len(array) // 8
    if words:
        array[: words * 8].view(np.uint64)[...] ^= np.frombuffer(key * 2, dtype=np.uint64)[0]
    for i in range(words * 8, len(array)):
        array[i] ^= key[i % 4]


def frame_header(opcode: int, size: int, mask: bytes | None, fin: bool = True) -> bytes:
    """The header of one frame of ``size`` payload bytes (with its masking key when given)."""
    first = (0x80 if fin else 0) | opcode
    flag = 0x80 if mask is not None else 0
    if size < 126:
        head = bytes((first, flag | size))
    elif size < 1 << 16:
        head = bytes((first, flag | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, flag | 127)) + size.to_bytes(8, "big")
    return head + mask if mask is not None else head


class _Refused(ProtocolError):
    """The peer broke the framing; ``code`` is the close code it is told."""

    def __init__(self, message: str, code: int = CLOSE_PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


class WebSocketProtocol(StreamProtocol):
    """One WebSocket connection, client or server side; see the module docstring."""

    def __init__(self, max_message_bytes: int, *, server: bool, uri: str = "ws://localhost/",
                 handshake_timeout: float = 10.0,
                 on_open: Callable[[WebSocketProtocol], None] | None = None,
                 admission: Admission | None = None, binding: bytes | None = None) -> None:
        super().__init__(max_message_bytes, admission=admission,
                         binding=(binding or b"") if server else None)
        self.server = server
        self._on_open = on_open
        self._handshake_timeout = handshake_timeout
        self._handshake: ServerProtocol | ClientProtocol | None = (
            ServerProtocol(max_size=None) if server else ClientProtocol(parse_uri(uri))
        )
        self._timer: asyncio.TimerHandle | None = None
        #: Resolved once the opening handshake succeeds (client side: ``connect`` waits on it).
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fragments: list[bytes | memoryview] | None = None  # a fragmented message so far
        self._fragment_bytes = 0
        self._close_sent = False
        self._searched = 0  # bytes of the handshake head searched for its end already

    # -- opening handshake ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.error is not None:  # refused
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._handshake_timeout, self._handshake_too_slow)
        handshake = self._handshake
        if isinstance(handshake, ClientProtocol):
            handshake.send_request(handshake.connect())
            self._write_handshake()

    def _handshake_too_slow(self) -> None:
        self._timer = None
        if self._handshake is not None and self.transport is not None:
            if self.server:
                stranger_log.warning("silent", f"dropped a connection from {self.remote}: no "
                                     f"WebSocket handshake within {self._handshake_timeout:g} s")
            self.protocol_error(ProtocolError(
                f"no WebSocket handshake with {self.remote} within {self._handshake_timeout:g} s"))

    def _write_handshake(self) -> None:
        assert self._handshake is not None and self.transport is not None
        for data in self._handshake.data_to_send():
            if data:
                self.write_bytes(data)

    def _parse_handshake(self, view: memoryview) -> int:
        start = max(self._searched - 3, 0)  # what was searched before, but a partial end
        found = bytes(view[start:HANDSHAKE_LIMIT]).find(b"\r\n\r\n")
        end = found + start if found >= 0 else -1
        if end < 0:
            self._searched = min(len(view), HANDSHAKE_LIMIT)
            if len(view) >= HANDSHAKE_LIMIT:
                self._refuse_handshake(f"an opening handshake over {HANDSHAKE_LIMIT} bytes")
            return 0
        used = end + 4
        handshake = self._handshake
        assert handshake is not None
        handshake.receive_data(bytes(view[:used]))
        events = handshake.events_received()
        if isinstance(handshake, ServerProtocol):
            request = events[0] if events and isinstance(events[0], Request) else None
            if request is None:
                self._refuse_handshake(str(handshake.handshake_exc or "not an HTTP request"))
                return used
            response = handshake.accept(request)
            handshake.send_response(response)
            self._write_handshake()
            if handshake.state is not State.OPEN:
                self._refuse_handshake(str(handshake.handshake_exc or response.status_code),
                                       answered=True)
                return used
        else:
            response_ = events[0] if events and isinstance(events[0], Response) else None
            if response_ is None or handshake.state is not State.OPEN:
                why = handshake.handshake_exc or "no valid handshake response"
                self.protocol_error(ProtocolError(f"{self.remote} refused the WebSocket "
                                                  f"handshake: {why}"))
                return used
        self._opened()
        return used

    def _refuse_handshake(self, why: str, answered: bool = False) -> None:
        if not self.server:
            self.protocol_error(ProtocolError(f"bad WebSocket handshake from {self.remote}: "
                                              f"{why}"))
            return
        stranger_log.warning("handshake", f"dropped a connection from {self.remote}: it failed "
                             f"the WebSocket handshake ({why})")
        if not answered and self.transport is not None:
            body = b"not a WebSocket handshake\n"
            self.write_bytes(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.fail(ProtocolError(f"bad WebSocket handshake from {self.remote}: {why}"))
        self.close_after_writes()  # after the refusal is written

    def _opened(self) -> None:
        self._discard_handshake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.opened.done():
            self.opened.set_result(None)
        if self._on_open is not None:
            self._on_open(self)

    # -- framing ------------------------------------------------------------------------------
    def parse(self, view: memoryview) -> int:
        if self._handshake is not None:
            return self._parse_handshake(view)
        try:
            return self._parse_frame(view)
        except _Refused as exc:
            self._send_close(exc.code, str(exc)[:100])
            raise

    def _parse_frame(self, view: memoryview) -> int:
        if len(view) < 2:
            return 0
        first, second = view[0], view[1]
        fin, opcode, masked, size = first & 0x80, first & 0x0F, second & 0x80, second & 0x7F
        at = 2
        if size == 126:
            if len(view) < 4:
                return 0
            size, at = int.from_bytes(view[2:4], "big"), 4
        elif size == 127:
            if len(view) < 10:
                return 0
            size, at = int.from_bytes(view[2:10], "big"), 10
        key = None
        if masked:
            if len(view) < at + 4:
                return 0
            key, at = bytes(view[at:at + 4]), at + 4
        self._check_frame(first & 0x70, opcode, bool(masked), bool(fin), size)
        if self.over_budget(at + size, len(view)):
            raise _Refused(str(self.preauth_error()), CLOSE_TOO_BIG)
        body = view[at:]
        if opcode >= OP_CLOSE:
            if len(body) < size:
                return 0
            self._control(opcode, self._unmasked(body[:size], key))
            return at + size
        if len(body) >= size:
            self._data(opcode, bool(fin), self._unmasked(body[:size], key))
            return at + size
        if size <= JOIN_BYTES:
            return 0  # a small frame: wait until it is all in the scratch buffer
        self.expect_payload(size, body,
                            lambda payload: self._data(opcode, bool(fin), payload, key),
                            message=key is None and bool(fin) and self._fragments is None)
        return len(view)

    def _check_frame(self, rsv: int, opcode: int, masked: bool, fin: bool, size: int) -> None:
        if rsv:
            raise _Refused(f"{self.remote} set reserved bits (no extension was negotiated)",
                           CLOSE_PROTOCOL)
        if opcode not in (OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG):
            raise _Refused(f"{self.remote} sent a frame with reserved opcode {opcode:#x}",
                           CLOSE_PROTOCOL)
        if masked != self.server:
            raise _Refused(f"{self.remote} sent {'an unmasked' if self.server else 'a masked'} "
                           "frame (RFC 6455 section 5.1)", CLOSE_PROTOCOL)
        if opcode >= OP_CLOSE:
            if not fin or size > 125:
                raise _Refused(f"{self.remote} sent a fragmented or oversized control frame",
                               CLOSE_PROTOCOL)
            return
        if opcode == OP_TEXT:
            raise _Refused(f"{self.remote} sent a text message; burncoll speaks binary",
                           CLOSE_UNSUPPORTED)
        if (opcode == OP_CONTINUATION) != (self._fragments is not None):
            raise _Refused(f"{self.remote} broke a fragmented message's sequence",
                           CLOSE_PROTOCOL)
        total = self._fragment_bytes + size
        if total > self.max_message_bytes:
            raise _Refused(
                f"message from {self.remote} exceeds the size limit ({total} bytes announced, "
                f"limit {self.max_message_bytes})", CLOSE_TOO_BIG)

    @staticmethod
    def _unmasked(payload: memoryview, key: bytes | None) -> memoryview:
        if key is None:
            return payload
        copy = memoryview(bytearray(payload))
        mask_in_place(copy, key)
        return copy

    def _data(self, opcode: int, fin: bool, payload: memoryview, key: bytes | None = None
              ) -> None:
        if key is not None:  # a payload received into its own buffer: unmask it there
            mask_in_place(payload, key)
        if fin and self._fragments is None:
            self.deliver(payload if payload.obj is not self._scratch else bytes(payload))
            return
        if self._fragments is None:
            self._fragments, self._fragment_bytes = [], 0
        most = PREAUTH_FRAGMENTS if self.unauthenticated else MAX_FRAGMENTS
        if len(self._fragments) >= most:
            self._send_close(CLOSE_TOO_BIG, "too many fragments")
            before = " before authenticating" if self.unauthenticated else ""
            self.protocol_error(ProtocolError(
                f"{self.remote} sent a message in more than {most} fragments{before} "
                "(the limit)"))
            return
        self._fragments.append(bytes(payload) if payload.obj is self._scratch else payload)
        self._fragment_bytes += len(payload)
        if fin:
            message = b"".join(self._fragments)
            self._fragments, self._fragment_bytes = None, 0
            self.deliver(message)

    def _control(self, opcode: int, payload: memoryview) -> None:
        if opcode == OP_PING:
            # RFC 6455 section 5.5.3: a pong may answer only the latest ping. Answer none while
            # earlier bytes still wait to be sent: a peer that pings and never reads cannot
            # make this side queue pongs without end.
            if self._write_backlog() == 0:
                self._write_frame(OP_PONG, bytes(payload))
        elif opcode == OP_CLOSE:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else CLOSE_NORMAL
            reason = bytes(payload[2:]).decode(errors="replace")
            self._send_close(code)
            error: TransportError
            if code == CLOSE_TOO_BIG:
                error = ProtocolError(f"{self.remote} rejected a message over its size limit "
                                      f"({reason})")
            else:
                error = TransportError(f"connection to {self.remote} closed by the peer "
                                       f"(code {code}{', ' + reason if reason else ''})")
            self.fail(error)
            self.close_after_writes()

    # -- sending ------------------------------------------------------------------------------
    def frame_header(self, size: int) -> bytes:
        return frame_header(OP_BINARY, size, None)

    def sends_plain(self) -> bool:
        return self.server and self._handshake is None  # a client masks every frame

    def write_message(self, views: list[memoryview], total: int) -> int | None:
        if self._handshake is not None:
            raise TransportError(f"the WebSocket to {self.remote} is not open")
        if self.server:
            return super().write_message(views, total)  # unmasked: the parts go as they are
        self._write_frame(OP_BINARY, *views)
        return None

    def _write_frame(self, opcode: int, *parts: Buffer) -> None:
        """One frame of ``parts`` joined: copied once, into the frame's own buffer, and masked
        there by a client."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        mask = None if self.server else secrets.token_bytes(4)
        header = frame_header(opcode, size, mask)
        frame = bytearray(len(header) + size)
        frame[:len(header)] = header
        at = len(header)
        for view in views:
            frame[at:at + len(view)] = view
            at += len(view)
        if mask is not None:
            mask_in_place(memoryview(frame)[len(header):], mask)
        self.write_bytes(frame)

    def _send_close(self, code: int, reason: str = "") -> None:
        if self._close_sent or self._handshake is not None:
            return
        self._close_sent = True
        with contextlib.suppress(TransportError):  # closed already
            self._write_frame(OP_CLOSE, code.to_bytes(2, "big") + reason.encode()[:120])

    def protocol_error(self, error: ProtocolError) -> None:
        """Tell the peer why (a close frame), then drop the connection once it is written.
        Before authentication, drop it at once: a stranger is owed no graceful close (and a
        TLS shutdown would wait on a socket that the spent budget no longer reads)."""
        if self.unauthenticated:
            super().protocol_error(error)
            return
        self.fail(error)
        self._direct = None
        self.close_after_writes()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.server and self._handshake is not None and self.error is None:
            stranger_log.warning("handshake", f"dropped a connection from {self.remote}: it "
                                 "failed the WebSocket handshake (closed before it was "
                                 "complete)")
        if not self.opened.done():
            self.opened.set_exception(fresh_error(self.error) if self.error else TransportError(
                f"connection to {self.remote} closed during the WebSocket handshake"))
            self.opened.exception()  # retrieved: connect() may have given up already
        self._discard_handshake()
        self._on_open = None
        super().connection_lost(exc)

    def _discard_handshake(self) -> None:
        """Drop the library's handshake state (its parser, a generator, refers back to it)."""
        handshake, self._handshake = self._handshake, None
        if handshake is not None:
            parser = getattr(handshake, "parser", None)
            close = getattr(parser, "close", None)
            if callable(close):
                close()


class WebSocketConnection(StreamConnection):
    """A :class:`~burncoll.transport.base.Connection` over one WebSocket."""

    _protocol: WebSocketProtocol

    def goodbye(self) -> None:
        self._protocol._send_close(CLOSE_NORMAL)


class WebSocketListener(StreamListener):
    """A bound WebSocket server; each opened connection runs the handler in its own task."""


class WebSocketTransport(Transport):
    """Listen and connect with WebSocket; ``wss`` when ``tls`` is given.

    Args:
        tls: ``wss`` when it asks for TLS (``tls.wanted``: any of ``cert``, ``key``, ``ca``, or
            ``ephemeral=True``), as described in :mod:`burncoll.transport.tls`; plain ``ws``
            for ``None`` or ``TlsSettings()``.
        max_message_bytes: the largest message this side accepts.
        connect_timeout: seconds for the TCP connect, TLS and WebSocket handshakes together
            (also how long a listener waits for a stranger's handshake).
        close_timeout: seconds ``close`` waits for the written bytes to leave.
        admission: makes each listener's :class:`~burncoll.transport.admission.Admission`
            (its caps and pre-authentication deadline); the defaults when ``None``.
    """

    name = "websocket"

    def __init__(
        self,
        *,
        tls: TlsSettings | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        connect_timeout: float = 10.0,
        close_timeout: float = 2.0,
        admission: Callable[[], Admission] | None = None,
    ) -> None:
        #: The TLS settings when ``wss`` is used, else ``None``.
        self.tls = tls if tls is not None and tls.wanted else None
        self.admission = admission or Admission
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self._client_ssl: ssl.SSLContext | None = None

    async def listen(self, host: str, port: int, handler: Handler) -> WebSocketListener:
        """Bind and serve; a stranger that fails the opening handshake is logged and dropped."""
        listener = WebSocketListener(host, port, self.admission())
        context = None if self.tls is None else server_ssl_context(self.tls, host)
        binding = b"" if self.tls is None else listener_binding(self.tls, host)
        close_timeout, max_message_bytes = self.close_timeout, self.max_message_bytes
        handshake_timeout, admission = self.connect_timeout, listener.admission

        def opened(protocol: WebSocketProtocol) -> None:
            listener.start(WebSocketConnection(protocol, close_timeout), handler)

        def factory() -> WebSocketProtocol:
            return WebSocketProtocol(max_message_bytes, server=True, on_open=opened,
                                     handshake_timeout=handshake_timeout, admission=admission,
                                     binding=binding)

        await listen_stream(host, port, factory, listener, context=context,
                            handshake_timeout=self.connect_timeout)
        return listener

    async def connect(self, host: str, port: int) -> WebSocketConnection:
        scheme = "ws" if self.tls is None else "wss"
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        extra: dict[str, Any] = {}
        if self.tls is not None:
            if self._client_ssl is None:
                self._client_ssl = client_ssl_context(self.tls)
            extra = {"ssl": self._client_ssl, "server_hostname": host}
        loop = asyncio.get_running_loop()
        uri = f"{scheme}://{netloc}/"

        def factory() -> WebSocketProtocol:
            return WebSocketProtocol(self.max_message_bytes, server=False, uri=uri,
                                     handshake_timeout=self.connect_timeout)

        protocol: WebSocketProtocol | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(factory, host, port, **extra)
                await asyncio.shield(protocol.opened)
        except (OSError, TimeoutError, ssl.SSLError, TransportError) as exc:
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()
            protocol = None  # this frame, kept by the traceback, must not keep it alive
            raise TransportError(f"cannot connect to {netloc} over {scheme}: {exc}") from exc
        return WebSocketConnection(protocol, self.close_timeout)
