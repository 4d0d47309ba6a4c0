"""WebSocket transport (RFC 6455): the ``websockets`` library's handshake, burncoll's framing.

One burncoll message is one binary WebSocket message. The library's sans-I/O
:class:`~websockets.server.ServerProtocol` and :class:`~websockets.client.ClientProtocol`
parse, validate and answer the HTTP Upgrade (refusals included); the frames after it are
parsed and checked by :mod:`burncoll.transport.ws_frames` and received by
:class:`WebSocketProtocol` on the zero-copy stream core (:mod:`burncoll.transport.stream`),
large unmasked payloads straight into their buffer. Array bytes travel from the server side,
unmasked (the receiving node dials the sending one); ``wss`` is the same over
:mod:`burncoll.transport.tls`. The rules, close codes and limits are in docs/multi-node.md
("Transports") and docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections.abc import Callable
from typing import Any

from websockets.client import ClientProtocol
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.admission import Admission, stranger_log
from burncoll.transport.base import Buffer, Handler, TlsSettings, Transport, format_address
from burncoll.transport.listening import StreamListener, listen_stream
from burncoll.transport.stream import JOIN_BYTES, StreamProtocol
from burncoll.transport.stream_connection import StreamConnection
from burncoll.transport.tls import client_ssl_context, listener_binding, server_ssl_context
from burncoll.transport.writer import fresh_error
from burncoll.transport.ws_frames import (
    CLOSE_NORMAL,
    CLOSE_TOO_BIG,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FrameError,
    FrameReader,
    close_payload,
    encode_frame,
    frame_header,
    mask_in_place,
    parse_close,
    unmasked,
)

__all__ = ["HANDSHAKE_LIMIT", "MAX_FRAGMENTS", "PREAUTH_FRAGMENTS", "WebSocketConnection",
           "WebSocketListener", "WebSocketProtocol", "WebSocketTransport"]


#: Longest opening handshake (request or response head) accepted.
HANDSHAKE_LIMIT = 16 * 1024
#: Most frames one incoming message may come in (the byte limit alone would let a stranger
#: send millions of empty fragments).
MAX_FRAGMENTS = 4096
#: Most frames one incoming message may come in before the peer authenticates.
PREAUTH_FRAGMENTS = 4


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
        self._frames = FrameReader(server=server, limit=max_message_bytes)
        self._close_sent = False
        self._searched = 0  # bytes of the handshake head searched for its end already

    # -- opening handshake ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._frames.remote = self.remote
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
        except FrameError as exc:
            self._send_close(exc.code, str(exc)[:100])
            raise

    def _parse_frame(self, view: memoryview) -> int:
        head = self._frames.header(view)
        if head is None:
            return 0
        fin, opcode, key, size, at = head
        if self.over_budget(at + size, len(view)):
            raise FrameError(str(self.preauth_error()), CLOSE_TOO_BIG)
        body = view[at:]
        if opcode >= OP_CLOSE:
            if len(body) < size:
                return 0
            self._control(opcode, unmasked(body[:size], key))
            return at + size
        if len(body) >= size:
            self._data(fin, unmasked(body[:size], key))
            return at + size
        if size <= JOIN_BYTES:
            return 0  # a small frame: wait until it is all in the scratch buffer
        self.expect_payload(size, body, lambda payload: self._data(fin, payload, key),
                            message=key is None and fin and self._frames.fragments is None)
        return len(view)

    def _data(self, fin: bool, payload: memoryview, key: bytes | None = None) -> None:
        if key is not None:  # a payload received into its own buffer: unmask it there
            mask_in_place(payload, key)
        frames = self._frames
        if fin and frames.fragments is None:
            self.deliver(payload if payload.obj is not self._scratch else bytes(payload))
            return
        most = PREAUTH_FRAGMENTS if self.unauthenticated else MAX_FRAGMENTS
        if frames.fragments is not None and len(frames.fragments) >= most:
            self._send_close(CLOSE_TOO_BIG, "too many fragments")
            before = " before authenticating" if self.unauthenticated else ""
            self.protocol_error(ProtocolError(
                f"{self.remote} sent a message in more than {most} fragments{before} "
                "(the limit)"))
            return
        message = frames.add(bytes(payload) if payload.obj is self._scratch else payload, fin)
        if message is not None:
            self.deliver(message)

    def _control(self, opcode: int, payload: memoryview) -> None:
        if opcode == OP_PING:
            # RFC 6455 section 5.5.3: a pong may answer only the latest ping. Answer none while
            # earlier bytes still wait to be sent: a peer that pings and never reads cannot
            # make this side queue pongs without end.
            if self._write_backlog() == 0:
                self._write_frame(OP_PONG, bytes(payload))
        elif opcode == OP_CLOSE:
            code, reason = parse_close(payload)
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

    def write_message(self, views: list[memoryview], total: int) -> int | None:
        if self._handshake is not None:
            raise TransportError(f"the WebSocket to {self.remote} is not open")
        if self.server:
            return super().write_message(views, total)  # unmasked: the parts go as they are
        self._write_frame(OP_BINARY, *views)
        return None

    def _write_frame(self, opcode: int, *parts: Buffer) -> None:
        """One frame of ``parts`` joined, masked by a client with a fresh random key."""
        mask = None if self.server else secrets.token_bytes(4)
        self.write_bytes(encode_frame(opcode, parts, mask))

    def _send_close(self, code: int, reason: str = "") -> None:
        if self._close_sent or self._handshake is not None:
            return
        self._close_sent = True
        with contextlib.suppress(TransportError):  # closed already
            self._write_frame(OP_CLOSE, close_payload(code, reason))

    def close_gracefully(self) -> None:
        """Send a close frame (1000) first, then close once everything is written."""
        with contextlib.suppress(OSError, RuntimeError, TransportError):  # closing anyway
            self._send_close(CLOSE_NORMAL)
        super().close_gracefully()

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
    """A :class:`~burncoll.transport.base.Connection` over one WebSocket (closing it sends a
    close frame first: :meth:`WebSocketProtocol.close_gracefully`)."""

    _protocol: WebSocketProtocol


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

    def __init__(self, *, tls: TlsSettings | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, connect_timeout: float = 10.0,
                 close_timeout: float = 2.0, admission: Callable[[], Admission] | None = None
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
        listener = WebSocketListener(host, port, handler, self.admission())
        context = None if self.tls is None else server_ssl_context(self.tls, host)
        binding = b"" if self.tls is None else listener_binding(self.tls, host)
        close_timeout, max_message_bytes = self.close_timeout, self.max_message_bytes
        handshake_timeout, admission = self.connect_timeout, listener.admission

        def opened(protocol: WebSocketProtocol) -> None:
            listener.start(WebSocketConnection(protocol, close_timeout))

        def factory() -> WebSocketProtocol:
            return WebSocketProtocol(max_message_bytes, server=True, on_open=opened,
                                     handshake_timeout=handshake_timeout, admission=admission,
                                     binding=binding)

        await listen_stream(host, port, factory, listener, context=context,
                            handshake_timeout=self.connect_timeout)
        return listener

    async def connect(self, host: str, port: int) -> WebSocketConnection:
        scheme = "ws" if self.tls is None else "wss"
        netloc = format_address((host, port))
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
