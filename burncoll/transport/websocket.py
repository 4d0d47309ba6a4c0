"""WebSocket transport (RFC 6455): the ``websockets`` library's handshake, burncoll's framing.

One burncoll message is one binary WebSocket message. The opening handshake is the
``websockets`` library's (its sans-I/O :class:`~websockets.server.ServerProtocol` and
:class:`~websockets.client.ClientProtocol` parse, validate and answer the HTTP Upgrade,
refusals included); the frames after it are read and written by
:class:`~burncoll.transport.ws_protocol.WebSocketProtocol` on burncoll's zero-copy stream core
(:mod:`burncoll.transport.stream`; the framing rules, sans I/O, in
:mod:`burncoll.transport.ws_frames`), because the library's own connection copies every
message several times and reaches a third of what the socket carries for array-sized messages
(``benchmarks/transport_throughput.py``).

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
  pre-authentication byte budget of :mod:`burncoll.transport.stream` covers the opening handshake
  and every frame (an HTTP head that does not end within it is refused), and a message may come
  in at most :data:`~burncoll.transport.ws_protocol.PREAUTH_FRAGMENTS` frames.

A stranger that fails the opening handshake gets the library's HTTP refusal (400/426) and is
dropped with a WARNING naming its address (bounded:
:class:`~burncoll.transport.admission.BoundedLog`); one that says nothing is dropped after
``connect_timeout`` (sooner by its listener's :class:`~burncoll.transport.admission.Admission`
deadline). Over wss a connection is admitted when it is accepted, before its TLS handshake
(:class:`~burncoll.transport.stream_listener.TlsGate`): the admission's caps and deadline
cover the handshake, which must also end within ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from burncoll.errors import TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.admission import Admission
from burncoll.transport.base import Handler, TlsSettings, Transport
from burncoll.transport.stream_connection import StreamConnection
from burncoll.transport.stream_listener import StreamListener, listen_stream
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
