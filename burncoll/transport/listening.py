"""What every listener (TCP, WebSocket, QUIC) does with the connections it accepts, and the
stream transports' (TCP, WebSocket) listening on TCP, with or without TLS.

:class:`ServingListener` runs the listener's handler on each accepted connection in a task of
its own, closes the connection when the handler returns (or fails: logged, never raised), and
ends them all when the listener closes: every connection is closed, each handler gets
:data:`HANDLER_GRACE` seconds to return, then is cancelled. A subclass binds the socket and
says how it shuts down (:meth:`ServingListener._shut_down`); admission of the connections
(:mod:`burncoll.transport.admission`) happens before they reach :meth:`ServingListener.serve`.

:class:`StreamListener` is the stream transports'. Without TLS, each accepted connection's
:class:`~burncoll.transport.stream.StreamProtocol` asks the listener's
:class:`~burncoll.transport.admission.Admission` itself when the connection is made. With TLS,
:class:`TlsGate` asks it before the TLS handshake, so that the pre-authentication caps and
deadline cover the handshake too.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging
import ssl
from collections.abc import Callable

from burncoll.errors import TransportError
from burncoll.transport.admission import Admission, Ticket, stranger_log
from burncoll.transport.base import Connection, Handler, Listener, format_address
from burncoll.transport.stream import StreamProtocol, host_of
from burncoll.transport.stream_connection import StreamConnection

__all__ = ["HANDLER_GRACE", "ServingListener", "StreamListener", "TlsGate", "listen_stream"]


logger = logging.getLogger("burncoll.transport")

#: How long ``Listener.close`` lets handlers finish before cancelling them.
HANDLER_GRACE = 1.0


class ServingListener(Listener):
    """A listener that serves ``handler`` on each connection it accepts (module docstring)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._closing: asyncio.Task[None] | None = None

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called: nothing more is served."""
        return self._closing is not None

    def serve(self, conn: Connection) -> None:
        """Run the handler on ``conn`` in a task of its own (the caller checks
        :attr:`closing` first)."""
        self._connections.add(conn)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _serve(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
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
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._shut_down())
        await asyncio.shield(self._closing)

    @abc.abstractmethod
    async def _shut_down(self) -> None:
        """Stop accepting, drop the connections still being admitted, and end the served
        ones (:meth:`_end_handlers`), in the order this listener's sockets need."""

    async def _end_handlers(self) -> None:
        """Close every served connection and end its handler (see the module docstring)."""
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
        tasks = list(self._handler_tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=HANDLER_GRACE)
        for task in pending:
            task.cancel()
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=HANDLER_GRACE)
            if stuck:
                logger.warning("listener %s:%s: a handler ignored cancellation",
                               self.host, self.port)


class StreamListener(ServingListener):
    """A bound TCP server; each opened connection runs the handler in its own task.

    ``admission`` (a default :class:`Admission` when ``None``) admits every accepted
    connection; the protocol factory passes it to each protocol.
    """

    def __init__(self, host: str, port: int, handler: Handler,
                 admission: Admission | None = None) -> None:
        super().__init__(handler)
        self.host = host
        self.port = port
        self.admission = admission if admission is not None else Admission()
        self._server: asyncio.Server | None = None
        #: TLS handshakes under way (:class:`TlsGate`); held here so that none is collected.
        self.handshakes: set[asyncio.Task[None]] = set()

    def bind(self, server: asyncio.Server) -> None:
        self._server = server
        sockname = server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]
        self.admission.name = f"listener {format_address(sockname)}"

    def start(self, conn: StreamConnection) -> None:
        """Serve ``conn`` (an opened connection), unless the listener is closing."""
        if self.closing:
            if conn.transport is not None:
                conn.transport.abort()
            return
        self.serve(conn)

    async def _shut_down(self) -> None:
        assert self._server is not None
        self._server.close()  # stop accepting
        self.admission.close()  # drops the connections still waiting to authenticate
        if self.handshakes:  # each ends at once: its connection was aborted
            await asyncio.wait(list(self.handshakes), timeout=HANDLER_GRACE)
        await self._end_handlers()


class TlsGate(asyncio.Protocol):
    """A TLS listener's first protocol on an accepted TCP connection: admission comes before
    the TLS handshake, so that the pre-authentication caps and deadline cover it.

    asyncio's own ``create_server(ssl=...)`` calls the application protocol's
    ``connection_made`` only once the handshake is done; until then each accepted socket holds
    a file descriptor, an OpenSSL object and TLS buffers that no cap counts. Instead:

    1. ``connection_made`` pauses reading and takes the connection's
       :class:`~burncoll.transport.admission.Ticket` at once (refused: aborted). Until the
       hand-over, an eviction or the pre-authentication deadline aborts the TCP connection.
    2. ``loop.start_tls`` runs the handshake, within ``handshake_timeout`` (the caller passes
       at most the admission's ``preauth_seconds``).
    3. On success the application protocol (made by ``app_factory``) gets the ticket and the
       TLS transport (:meth:`StreamProtocol.handed_over`), and later drops go to its
       :meth:`StreamProtocol.drop`. On failure the ticket is released, the connection aborted,
       and the failure logged (bounded: :data:`~burncoll.transport.admission.stranger_log`)
       unless the admission dropped it (it logged that).
    """

    def __init__(self, app_factory: Callable[[], StreamProtocol], context: ssl.SSLContext,
                 admission: Admission, handshake_timeout: float,
                 handshakes: set[asyncio.Task[None]]) -> None:
        self._app_factory = app_factory
        self._context = context
        self._admission = admission
        self._handshake_timeout = handshake_timeout
        self._handshakes = handshakes
        self._raw: asyncio.Transport | None = None
        self._app: StreamProtocol | None = None
        self.remote = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # nothing is read before the handshake starts
        peer = transport.get_extra_info("peername")
        self.remote = format_address(peer)
        ticket = self._admission.admit(host_of(peer), self._drop)
        if ticket is None:  # refused (and logged)
            transport.abort()
            return
        self._raw = transport
        task = asyncio.get_running_loop().create_task(self._handshake(transport, ticket))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def connection_lost(self, exc: Exception | None) -> None:
        """Lost before ``start_tls`` took the transport over: :meth:`_handshake` sees it
        closing and releases the ticket."""

    def _drop(self, reason: str) -> None:
        """The ticket's ``drop``: abort the TCP connection until the hand-over, then the
        application protocol's :meth:`~StreamProtocol.drop`."""
        if self._app is not None:
            self._app.drop(reason)
        elif self._raw is not None:
            self._raw.abort()

    async def _handshake(self, raw: asyncio.Transport, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        tls: asyncio.BaseTransport | None = None
        failure = "closed before the TLS handshake"
        if not raw.is_closing() and not ticket.released:
            app = self._app_factory()
            try:
                tls = await loop.start_tls(raw, app, self._context, server_side=True,
                                           ssl_handshake_timeout=self._handshake_timeout)
            except (OSError, TimeoutError, RuntimeError) as exc:
                failure = f"TLS handshake failed: {exc or type(exc).__name__}"
            else:
                failure = "closed during the TLS handshake"
            if (isinstance(tls, asyncio.Transport) and not tls.is_closing()
                    and not ticket.released):
                self._app, self._raw = app, None
                app.handed_over(tls, ticket)
                return
        self._raw = None
        evicted = ticket.released  # the admission dropped it, and logged why
        ticket.release()
        raw.abort()
        if not evicted:
            stranger_log.warning("tls", f"dropped a connection from {self.remote}: {failure}")


async def listen_stream(host: str, port: int, factory: Callable[[], StreamProtocol],
                        listener: StreamListener, *, context: ssl.SSLContext | None = None,
                        handshake_timeout: float = 10.0) -> None:
    """Bind ``listener`` to ``host:port`` serving ``factory``; TransportError naming the port.

    With ``context``, TLS: each connection is admitted by ``listener.admission`` before its
    TLS handshake (:class:`TlsGate`), which must end within ``handshake_timeout`` seconds and
    the admission's ``preauth_seconds``; ``factory``'s protocol gets the admitted connection
    once it is encrypted. Without, ``factory``'s protocol admits its connection itself.
    """
    loop = asyncio.get_running_loop()
    serve: Callable[[], asyncio.BaseProtocol] = factory
    if context is not None:
        admission, handshakes = listener.admission, listener.handshakes
        timeout = min(handshake_timeout, admission.preauth_seconds)

        def serve() -> TlsGate:
            return TlsGate(factory, context, admission, timeout, handshakes)

    try:
        server = await loop.create_server(serve, host, port)
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise TransportError(f"cannot listen on {host}:{port}: {reason}") from exc
    listener.bind(server)
