"""The transport interface: message-oriented, authenticated connections between nodes.

A transport moves whole *messages* (a burncoll frame: header plus payload) between two
endpoints, in order, reliably, or fails loudly. It knows nothing of arrays or collectives.
Implementations map their library's exceptions to :class:`~burncoll.TransportError` at this
boundary (``raise TransportError(...) from exc``), so callers never see a
``websockets`` or ``aioquic`` exception.

Connections are used from one asyncio event loop (the node's I/O loop).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from burncoll.errors import TransportError
from burncoll.protocol.control import ControlMessage, encode
from burncoll.protocol.wire import Placed

__all__ = [
    "PREAUTH_BYTES",
    "PREAUTH_SECONDS",
    "Buffer",
    "Connection",
    "FastPath",
    "Placer",
    "Handler",
    "Listener",
    "TlsSettings",
    "Transport",
    "byte_view",
    "format_address",
    "tell",
]

#: Most bytes a transport reads from a connection before it is :meth:`Connection.authenticated`
#: (opening handshake and authentication messages together); see that method.
PREAUTH_BYTES = 16 * 1024
#: Seconds a connection may stay unauthenticated; a listener drops it then, whatever it sent.
PREAUTH_SECONDS = 5.0

#: Anything ``bytes(...)`` accepts without copying semantics surprises.
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """Certificate paths (PEM); see :mod:`burncoll.transport.tls` for how they are used.

    All ``None`` (and ``ephemeral`` false): no TLS where it is optional (WebSocket), and an
    ephemeral self-signed certificate, not verified by clients, where it is not (QUIC).
    ``ca`` set: clients verify the listener's certificate against it.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    #: Use TLS where it is optional (WebSocket: ``wss``) even without certificate paths: the
    #: listener then presents an ephemeral self-signed certificate, and the token
    #: authentication, bound to that certificate, authenticates both ends.
    ephemeral: bool = False

    @property
    def wanted(self) -> bool:
        """Whether TLS is asked for where it is optional."""
        return self.ephemeral or any((self.cert, self.key, self.ca))


class Connection(abc.ABC):
    """One bidirectional, ordered, reliable message channel."""

    #: ``"host:port"`` of the other end, for messages and logs.
    remote: str

    @abc.abstractmethod
    async def send(self, parts: Sequence[Buffer]) -> None:
        """Send one message made of ``parts`` joined end to end.

        Returns once the bytes are handed to the operating system or the library's buffer:
        the caller may then modify the memory ``parts`` refer to. Raises
        :class:`~burncoll.TransportError` when the connection is closed or broken.
        """

    @abc.abstractmethod
    async def recv(self) -> Buffer | Placed:
        """Receive the next whole message (a :class:`~burncoll.protocol.wire.Placed` only
        after :meth:`FastPath.place_with`).

        Raises :class:`~burncoll.TransportError` when the connection closes (cleanly or not)
        before a message arrives, and :class:`~burncoll.ProtocolError` for a message over the
        size limit.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection; idempotent. Pending ``recv`` calls raise TransportError."""

    @abc.abstractmethod
    def authenticated(self) -> None:
        """The other side has proved it holds the token: lift the pre-authentication limits.

        Until this is called a connection is *unauthenticated* and every transport reads at
        most :data:`PREAUTH_BYTES` bytes from it in total (handshake and authentication
        messages included, whatever arrives pipelined behind them), grants the other side no
        more than that much flow-control credit, and allocates nothing larger on its word. A
        message or frame that would go past the budget drops the connection with a
        :class:`~burncoll.ProtocolError` that names the limit. Called once, by
        :mod:`burncoll.transport.auth`, on both ends.
        """

    @abc.abstractmethod
    def channel_binding(self) -> bytes:
        """What ties an authentication exchange to this channel (RFC 5929
        ``tls-server-end-point``): the SHA-256 of the DER certificate the *listener* presents
        -- its own on the accepting side, the one received on the connecting side -- or
        ``b""`` on a connection without TLS. A relay that terminates TLS presents another
        certificate, so the two ends compute different bindings and authentication fails."""


async def tell(conn: Connection, message: ControlMessage | bytes, timeout: float, *,
               session: int = 0, lock: asyncio.Lock | None = None) -> bool:
    """Best effort: send ``message`` (or its frame, encoded already) on ``conn`` (under
    ``lock``, if given), within ``timeout``; ``False`` when the other end is gone or too slow
    (never an error: the caller has nothing better to do about a closed peer)."""
    frame = message if isinstance(message, bytes) else encode(message, session)
    try:
        async with asyncio.timeout(timeout), lock or contextlib.nullcontext():
            await conn.send([frame])
    except (TransportError, TimeoutError):
        return False
    return True

#: ``placer(first_bytes, size)``: where a large incoming payload of ``size`` bytes is received,
#: chosen from its first bytes (the frame header): ``(offset, memory)`` or ``None`` for "in a
#: buffer of the transport's own".
Placer = Callable[[memoryview, int], tuple[int, memoryview] | None]


@runtime_checkable
class FastPath(Protocol):
    """The zero-copy fast path that some connections offer besides :class:`Connection`.

    Callers check for it once (``isinstance(conn, FastPath)``, when the connection is made) and
    otherwise use the plain :class:`Connection` methods.
    """

    def place_with(self, placer: Placer) -> None:
        """Let ``placer`` choose where each large incoming payload is received."""

    def stop_placing(self) -> None:
        """Undo :meth:`place_with`, and write nothing more into memory the placer chose."""


#: Called once per accepted connection; the connection is closed when it returns.
Handler = Callable[[Connection], Awaitable[None]]


class Listener(abc.ABC):
    """A bound server socket accepting connections."""

    #: The bound ``(host, port)``; the port is the real one when 0 was asked for.
    host: str
    port: int

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting and close every accepted connection; idempotent."""


class Transport(abc.ABC):
    """A way to listen and connect (WebSocket, QUIC, ...)."""

    #: The config spelling: ``"websocket"`` or ``"quic"``.
    name: str

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        """Bind ``host:port`` (0 = ephemeral) and serve ``handler`` per connection.

        Raises :class:`~burncoll.TransportError` naming the port when it cannot be bound.
        """

    @abc.abstractmethod
    async def connect(self, host: str, port: int) -> Connection:
        """Open a connection to ``host:port``.

        Raises :class:`~burncoll.TransportError` when nothing answers (callers retry).
        """


def format_address(address: Any) -> str:
    """``"host:port"`` (``"[v6]:port"``) for a socket address tuple; ``"?"`` when unknown."""
    if not isinstance(address, tuple) or len(address) < 2:
        return "?"
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def byte_view(part: Buffer) -> memoryview:
    """``part`` as a flat byte view: ``len`` is then its size in bytes."""
    view = memoryview(part)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
