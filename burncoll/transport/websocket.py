"""WebSocket transport (RFC 6455) on the ``websockets`` asyncio API; ``wss`` with TLS.

One burncoll message is one binary WebSocket message. Choices, and why:

* ``compression=None``: permessage-deflate (RFC 7692) costs far more CPU than array bytes
  save; it is never negotiated.
* ``max_size=max_message_bytes``: a larger incoming message closes the connection with code
  1009 (RFC 6455 section 7.4.1); the receiver raises :class:`~burncoll.ProtocolError`, and so
  does the sender's next ``recv``. The limit applies to incoming messages only.
* ``write_limit``: the socket's write buffer may hold 16 MiB before ``send`` waits
  (the library default, 32 KiB, caps throughput on fast links). ``max_queue``: a receiver
  queues up to 1024 frames (sixteen 64 MiB messages) before it stops reading and the sender's
  ``send`` waits; receive concurrently with sending when exchanging more than that.
* No keepalive pings (``ping_interval=None``): a ping queued behind a 64 MiB message on a slow
  link would time out and kill a healthy connection. Liveness is the collective's business:
  every operation has a deadline, and a dead peer's kernel resets the TCP connection.
* ``proxy=None``: nodes talk directly, whatever ``HTTPS_PROXY`` says.
* A large message is sent as one fragmented message (RFC 6455 section 5.4) of 1 MiB frames
  sliced from the parts: the payload is never concatenated with its header into a new buffer,
  and the event loop serves other connections between frames (one 64 MiB frame would block it
  for tens to hundreds of milliseconds while it is masked and copied). This measured faster than
  one frame per part. Small messages are joined and sent as a single frame.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.connection import Connection as WsConnection
from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, WebSocketException
from websockets.frames import CloseCode
from websockets.protocol import State

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.base import (
    Buffer,
    Connection,
    Handler,
    Listener,
    TlsSettings,
    Transport,
    byte_view,
    format_address,
)
from burncoll.transport.tls import client_ssl_context, server_ssl_context
from burncoll.transport.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["WebSocketConnection", "WebSocketListener", "WebSocketTransport"]

logger = logging.getLogger("burncoll.transport")

#: Messages up to this size go as one frame; larger ones as frames of about this size.
_FRAGMENT_BYTES = 1024 * 1024
#: Most frames per message: the receiving library refuses more than 4096.
_MAX_FRAGMENTS = 1024
#: Frames a receiver queues before it stops reading the socket (and the sender then waits):
#: sixteen 64 MiB messages, or a thousand small ones.
_RECEIVE_QUEUE_FRAMES = 1024
#: High-water mark of the socket write buffer.
_WRITE_LIMIT = 16 * 1024 * 1024
#: How long ``Listener.close`` lets handlers finish before cancelling them.
_HANDLER_GRACE = 1.0




def _fragments(views: list[memoryview], size: int) -> list[memoryview]:
    """The parts cut into slices of at most ``size`` bytes (views: nothing is copied)."""
    return [view[i : i + size] for view in views for i in range(0, len(view), size)]


def _closed_error(exc: ConnectionClosed, remote: str) -> TransportError:
    """The burncoll error for a closed WebSocket, ProtocolError for size violations."""
    if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
        return ProtocolError(f"message from {remote} exceeds the size limit ({exc.sent.reason})")
    if exc.rcvd is not None and exc.rcvd.code == CloseCode.MESSAGE_TOO_BIG:
        return ProtocolError(f"{remote} rejected a message over its size limit")
    return TransportError(f"connection to {remote} closed ({exc})")


def _limit_attribute(ws: WsConnection) -> str:
    """The protocol attribute holding the incoming message limit in this websockets version."""
    return "max_message_size" if hasattr(ws.protocol, "max_message_size") else "max_size"


class WebSocketConnection(Connection):
    """A :class:`Connection` over one WebSocket; see the module docstring for the framing."""

    def __init__(self, ws: WsConnection) -> None:
        self._ws = ws
        self._max_size: int | None = getattr(ws.protocol, _limit_attribute(ws), None)
        self.remote = format_address(ws.remote_address)
        self._recv_lock = asyncio.Lock()

    def limit_incoming(self, max_bytes: int | None) -> None:
        # websockets >= 14 reads ``max_message_size`` for every frame; older ones ``max_size``
        setattr(self._ws.protocol, _limit_attribute(self._ws),
                max_bytes if max_bytes is not None else self._max_size)

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [byte_view(p) for p in parts]
        total = sum(len(v) for v in views)
        message: Buffer | list[memoryview]
        if len(views) == 1 and total <= _FRAGMENT_BYTES:
            message = views[0]
        elif total <= _FRAGMENT_BYTES or len(views) > _MAX_FRAGMENTS // 2:
            message = b"".join(views)
        else:
            message = _fragments(views, max(_FRAGMENT_BYTES, -(-total // _MAX_FRAGMENTS)))
        try:
            await self._ws.send(message, text=False)
        except ConnectionClosed as exc:
            raise _closed_error(exc, self.remote) from exc
        except (OSError, WebSocketException) as exc:
            raise TransportError(f"sending to {self.remote} failed: {exc}") from exc

    async def recv(self) -> Buffer:
        # The library refuses concurrent recv calls; serialize them instead.
        async with self._recv_lock:
            try:
                message = await self._ws.recv(decode=False)
            except ConnectionClosed as exc:
                raise _closed_error(exc, self.remote) from exc
            except (OSError, WebSocketException) as exc:
                raise TransportError(f"receiving from {self.remote} failed: {exc}") from exc
        return message

    async def close(self) -> None:
        # The library bounds the closing handshake by close_timeout, but not the wait to
        # write the close frame, which lasts forever when the peer stops reading: bound it.
        deadline = 2 * (self._ws.close_timeout or 10.0)
        try:
            async with asyncio.timeout(deadline):
                await self._ws.close()
        except TimeoutError:
            self._ws.transport.abort()
        except (OSError, WebSocketException):
            pass  # it is closed, one way or another


class WebSocketListener(Listener):
    """A bound WebSocket server; each accepted connection runs the handler in its own task."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._server: Server | None = None
        self._handler_tasks: set[asyncio.Task[Any]] = set()
        self._connections: set[WebSocketConnection] = set()
        self._closing: asyncio.Task[None] | None = None

    def _bind(self, server: Server) -> None:
        self._server = server
        sockname = server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

    async def _serve(self, ws: ServerConnection, handler: Handler) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handler_tasks.add(task)
        conn = WebSocketConnection(ws)
        self._connections.add(conn)
        try:
            await handler(conn)
        except TransportError as exc:
            logger.debug("connection from %s ended: %s", conn.remote, exc)
        except Exception:
            logger.exception("handler for the connection from %s failed", conn.remote)
        finally:
            self._handler_tasks.discard(task)
            self._connections.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._server is None:
            return
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(self._server))
        await asyncio.shield(self._closing)

    async def _close(self, server: Server) -> None:
        server.close(close_connections=False)  # stop accepting
        # Close the connections ourselves: our close is bounded even when a peer stops reading.
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(c.close() for c in connections))
        try:
            async with asyncio.timeout(_HANDLER_GRACE):
                await server.wait_closed()
        except TimeoutError:
            for task in list(self._handler_tasks):
                task.cancel()
            try:
                async with asyncio.timeout(_HANDLER_GRACE):
                    await server.wait_closed()
            except TimeoutError:
                logger.warning(
                    "listener %s:%s: a handler ignored cancellation", self.host, self.port
                )


class _LoggedServerConnection(ServerConnection):
    """A server connection that says, at WARNING, why an opening handshake failed."""

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().handshake(*args, **kwargs)
        finally:
            if self.protocol.state is not State.OPEN:
                failure = self.protocol.handshake_exc or "no valid opening handshake"
                logger.warning("dropped a connection from %s: it failed the WebSocket "
                               "handshake (%s)", format_address(self.remote_address), failure)


class WebSocketTransport(Transport):
    """Listen and connect with WebSocket; ``wss`` when ``tls`` is given.

    Args:
        tls: ``wss`` when it sets any of ``cert``, ``key``, ``ca``, as described in
            :mod:`burncoll.transport.tls`; plain ``ws`` for ``None`` or ``TlsSettings()``.
        max_message_bytes: the largest message this side accepts.
        connect_timeout: seconds for the TCP connect, TLS and WebSocket handshakes together.
        close_timeout: seconds ``close`` waits for the peer's closing handshake.
    """

    name = "websocket"

    def __init__(
        self,
        *,
        tls: TlsSettings | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        connect_timeout: float = 10.0,
        close_timeout: float = 2.0,
    ) -> None:
        #: The TLS settings when ``wss`` is used, else ``None``.
        self.tls = tls if tls is not None and any((tls.cert, tls.key, tls.ca)) else None
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self._client_ssl: ssl.SSLContext | None = None

    def _options(self) -> dict[str, Any]:
        return {
            "compression": None,
            "max_size": self.max_message_bytes,
            "max_queue": _RECEIVE_QUEUE_FRAMES,
            "write_limit": _WRITE_LIMIT,
            "ping_interval": None,
            "close_timeout": self.close_timeout,
            "open_timeout": self.connect_timeout,
        }

    async def listen(self, host: str, port: int, handler: Handler) -> WebSocketListener:
        """Bind and serve; a stranger that fails the opening handshake is logged and dropped."""
        listener = WebSocketListener(host, port)
        context = None if self.tls is None else server_ssl_context(self.tls, host)

        async def serve_one(ws: ServerConnection) -> None:
            await listener._serve(ws, handler)

        try:
            server = await ws_serve(
                serve_one, host, port, ssl=context, server_header=None,
                create_connection=_LoggedServerConnection, **self._options()
            )
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise TransportError(f"cannot listen on {host}:{port}: {reason}") from exc
        listener._bind(server)
        return listener

    async def connect(self, host: str, port: int) -> WebSocketConnection:
        scheme = "ws" if self.tls is None else "wss"
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        extra: dict[str, Any] = {}
        if self.tls is not None:
            if self._client_ssl is None:
                self._client_ssl = client_ssl_context(self.tls)
            extra["ssl"] = self._client_ssl
        try:
            ws: ClientConnection = await ws_connect(
                f"{scheme}://{netloc}/",
                proxy=None,
                user_agent_header=None,
                **self._options(),
                **extra,
            )
        except (OSError, TimeoutError, InvalidHandshake, WebSocketException) as exc:
            raise TransportError(f"cannot connect to {netloc} over {scheme}: {exc}") from exc
        return WebSocketConnection(ws)
