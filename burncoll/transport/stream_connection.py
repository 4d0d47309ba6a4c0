"""The :class:`~burncoll.transport.base.Connection` over the zero-copy stream core.

Besides the plain interface it offers the fast path
(:class:`~burncoll.transport.base.FastPath`): large payloads received straight into memory
their receiver chose (:meth:`StreamConnection.place_with`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from burncoll.errors import TransportError
from burncoll.protocol.wire import Placed
from burncoll.transport.base import Buffer, Connection, Placer, byte_view
from burncoll.transport.stream import StreamProtocol

__all__ = ["StreamConnection"]


class StreamConnection(Connection):
    """A :class:`Connection` over a :class:`StreamProtocol`; implements
    :class:`~burncoll.transport.base.FastPath`."""

    def __init__(self, protocol: StreamProtocol, close_timeout: float = 2.0) -> None:
        self._protocol = protocol
        self.remote = protocol.remote
        self.close_timeout = close_timeout
        self._closing = False

    def pause_reading(self) -> None:
        """Read nothing more from the socket until it is :meth:`detach`-ed (or closed)."""
        transport = self._protocol.transport
        if transport is not None:
            transport.pause_reading()

    def detach(self) -> socket.socket:
        """The socket, out of the event loop (see :meth:`StreamProtocol.detach`); the
        connection is closed."""
        sock = self._protocol.detach()
        self._closing = True
        return sock

    def place_with(self, placer: Placer) -> None:
        """Let ``placer`` choose where each large incoming payload is received (see
        :meth:`StreamProtocol.expect_payload`)."""
        self._protocol.placer = placer

    def stop_placing(self) -> None:
        self._protocol.stop_placing()

    def authenticated(self) -> None:
        self._protocol.authenticated()

    def channel_binding(self) -> bytes:
        return self._protocol.binding or b""

    @property
    def transport(self) -> asyncio.Transport | None:
        """The asyncio transport under the connection (``None`` once it is lost)."""
        return self._protocol.transport

    async def send(self, parts: Sequence[Buffer]) -> None:
        if self._closing:
            raise TransportError(f"the connection to {self.remote} was closed")
        views = [byte_view(p) for p in parts]
        total = sum(len(v) for v in views)
        protocol = self._protocol
        try:
            offset = protocol.write_message(views, total)
        except (OSError, RuntimeError) as exc:
            raise TransportError(f"sending to {self.remote} failed: {exc}") from exc
        await protocol.wait_sent(offset)

    async def recv(self) -> Buffer | Placed:
        return await self._protocol.next_message()

    async def close(self) -> None:
        protocol = self._protocol
        if not self._closing:
            self._closing = True
            transport = protocol.transport
            if transport is not None and not transport.is_closing():
                protocol.close_gracefully()  # flushes what was written, then closes
            protocol.fail(TransportError(f"the connection to {self.remote} was closed"))
        try:
            await asyncio.wait_for(asyncio.shield(protocol.lost), self.close_timeout)
        except TimeoutError:
            if protocol.transport is not None:
                protocol.transport.abort()
