"""WebSocket transport (RFC 6455): the ``websockets`` library's handshake, burncoll's framing.

One burncoll message is one binary WebSocket message. The library's sans-I/O
:class:`~websockets.server.ServerProtocol` and :class:`~websockets.client.ClientProtocol`
answer the HTTP Upgrade (refusals included); the frames after it are read and written by
:class:`~burncoll.transport.ws_protocol.WebSocketProtocol` on the zero-copy stream core
(:mod:`burncoll.transport.stream`; framing rules in :mod:`burncoll.transport.ws_frames`).
Array bytes travel from the server side, unmasked (the receiving node dials the sending one);
``wss`` is the same over :mod:`burncoll.transport.tls`. The rules, close codes and limits are in
docs/multi-node.md ("Transports") and docs/security.md.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from burncoll.errors import TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.admission import Admission
from burncoll.transport.base import Handler, TlsSettings, Transport, format_address
from burncoll.transport.listening import StreamListener, listen_stream
from burncoll.transport.stream_connection import StreamConnection
from burncoll.transport.tls import client_ssl_context, listener_binding, server_ssl_context
from burncoll.transport.ws_protocol import WebSocketProtocol

__all__ = ["WebSocketConnection", "WebSocketListener", "WebSocketTransport"]


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
