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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from burncoll.transport.wire import Placed

__all__ = [
    "Buffer",
    "Connection",
    "Handler",
    "Listener",
    "TlsSettings",
    "Transport",
    "byte_view",
    "format_address",
]

#: Anything ``bytes(...)`` accepts without copying semantics surprises.
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """Certificate paths (PEM); see :mod:`burncoll.transport.tls` for how they are used.

    All ``None``: no TLS where it is optional (WebSocket), and an ephemeral self-signed
    certificate, not verified by clients, where it is not (QUIC). ``ca`` set: clients verify
    the listener's certificate against it.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None


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
        """Receive the next whole message (a :class:`~burncoll.transport.wire.Placed` only
        after :meth:`place_with`).

        Raises :class:`~burncoll.TransportError` when the connection closes (cleanly or not)
        before a message arrives, and :class:`~burncoll.ProtocolError` for a message over the
        size limit.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection; idempotent. Pending ``recv`` calls raise TransportError."""

    def send_now(self, parts: Sequence[Buffer]) -> bool:
        """From any thread: send a small message at once, bypassing the event loop, and
        return ``True``; or do nothing and return ``False`` when this connection cannot
        (the default), and the caller uses :meth:`send` on the loop."""
        return False

    def place_with(self, placer: Callable[[memoryview, int], tuple[int, memoryview] | None]
                   ) -> None:
        """Let ``placer(first_bytes, size)`` choose where a large incoming message's payload
        is received (see ``StreamProtocol.expect_payload``); transports that cannot ignore it.
        """
        return None

    def stop_placing(self) -> None:
        """Undo :meth:`place_with`, and write nothing more into memory the placer chose
        (a payload arriving now goes to a buffer of the transport's own)."""
        return None

    def limit_incoming(self, max_bytes: int | None) -> None:
        """From the next message on, refuse incoming messages over ``max_bytes`` (``None``:
        back to the transport's own limit). Used while a stranger is not yet authenticated, so
        that it cannot make this side allocate a large buffer. Transports that cannot change
        the limit on a live connection keep theirs."""
        return None  # the default: the transport's limit stays


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
