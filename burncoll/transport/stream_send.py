"""The sending half of the zero-copy stream core (:mod:`burncoll.transport.stream`).

The header and each part of a message are queued without being joined (small messages
excepted) on a :class:`~burncoll.transport.writer.SocketWriter`, which hands them to
``sendmsg`` as the socket drains; ``send`` returns once they are in the kernel. Small messages
(up to :data:`JOIN_BYTES`) are joined into one buffer and ``send`` returns at once, unless more
than :data:`WRITE_HIGH_WATER` bytes are pending. Over TLS the writer cannot be used (TLS
encrypts in the transport): the transport's ``write`` then (it copies).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from typing import Any

from burncoll.errors import TransportError
from burncoll.transport.tls import binding_of_certificate
from burncoll.transport.writer import SocketWriter, fresh_error

__all__ = ["JOIN_BYTES", "WRITE_HIGH_WATER", "StreamSending"]

#: Messages up to this size are joined with their header into one write (and received
#: whole in the scratch buffer).
JOIN_BYTES = 64 * 1024
#: ``send`` waits while more than this many bytes wait in the transport's buffer.
WRITE_HIGH_WATER = 16 * 1024 * 1024
#: Socket buffer sizes asked of the kernel (it may grant less).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def set_no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small messages at once (no Nagle delay)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def enlarge_socket_buffers(transport: asyncio.BaseTransport) -> None:
    """Ask the kernel for :data:`SOCKET_BUFFER_BYTES` socket buffers (only once the peer has
    authenticated: a stranger gets the kernel's defaults)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # the kernel's defaults then
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def binding_of_peer(transport: asyncio.BaseTransport) -> bytes:
    """The channel binding of the certificate the other end presented (``b""`` without TLS)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    der = ssl_object.getpeercert(binary_form=True)
    return binding_of_certificate(der) if der else b""


def host_of(address: Any) -> str:
    """The host part of a socket address (what admission counts sources by)."""
    return str(address[0]) if isinstance(address, tuple) and address else "?"


class StreamSending(abc.ABC):
    """What every stream protocol holds -- its transport, the other end's address, why it
    failed -- and how it sends; the framing supplies :meth:`frame_header`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        #: ``"host:port"`` of the other end, for messages and logs.
        self.remote = "?"
        #: Why the connection is unusable (the first reason wins); recv raises it when empty.
        self.error: TransportError | None = None
        self._writer: SocketWriter | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    @abc.abstractmethod
    def frame_header(self, size: int) -> bytes:
        """The bytes that go before a message of ``size`` bytes."""

    def write_message(self, views: list[memoryview], total: int) -> int | None:
        """Queue a whole message at once (no await: messages never interleave).

        Returns the writer offset to wait for before the caller may modify ``views`` (see
        :meth:`wait_sent`), or ``None`` when they were copied.
        """
        header = self.frame_header(total)
        if total <= JOIN_BYTES:
            self.write_bytes(b"".join([header, *views]))
            return None
        transport = self._open_transport()
        if self._writer is not None:
            return self._writer.write([memoryview(header), *views])
        transport.write(header)
        for view in views:
            if view:
                transport.write(view)
        return None

    def _write_backlog(self) -> int:
        """Bytes written but not yet handed to the kernel."""
        if self._writer is not None:
            return self._writer.pending_bytes
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def _open_transport(self) -> asyncio.Transport:
        transport = self.transport
        if self.error is not None:
            raise fresh_error(self.error)
        if transport is None or transport.is_closing():
            raise TransportError(f"connection to {self.remote} is closed")
        return transport

    def write_bytes(self, data: bytes | bytearray) -> None:
        """Queue ``data`` (the caller's to keep: it is not copied) after everything before."""
        transport = self._open_transport()
        if self._writer is not None:
            self._writer.write([memoryview(data)])
        else:
            transport.write(data)

    async def wait_sent(self, offset: int | None) -> None:
        """Wait until the bytes before ``offset`` are sent (``None``: until no more than
        :data:`WRITE_HIGH_WATER` bytes are pending)."""
        writer = self._writer
        if writer is None:
            if self._write_paused:
                await self.drain()
            return
        if offset is None:
            if writer.pending_bytes <= WRITE_HIGH_WATER:
                return
            offset = writer.write([]) - WRITE_HIGH_WATER
        waiter = writer.sent(offset)
        if waiter is not None:
            await waiter

    def close_after_writes(self) -> None:
        """Close the transport once everything queued is written."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._writer is not None and self._writer.error is None:
            self._writer.when_empty(transport.close)
        else:
            transport.close()

    def close_gracefully(self) -> None:
        """The local side closes: end the connection once everything queued is written (a
        WebSocket says goodbye first)."""
        self.close_after_writes()

    async def drain(self) -> None:
        """Wait while the transport has paused writing (its buffer over the high water)."""
        while self._write_paused and self.error is None:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
        if self.error is not None and (self.transport is None or self.transport.is_closing()):
            raise fresh_error(self.error)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
