"""Shared pieces of the transport tests: the transports under test and a served listener."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

from burncoll.transport.base import Connection, Listener, TlsSettings, Transport
from burncoll.transport.quic import QuicTransport
from burncoll.transport.tcp import TcpTransport
from burncoll.transport.tls import make_self_signed
from burncoll.transport.websocket import WebSocketTransport

T = TypeVar("T")
HOST = "127.0.0.1"

#: How a test builds a transport: ``make(**options)``.
MakeTransport = Callable[..., Transport]


def _websocket(**options: Any) -> Transport:
    return WebSocketTransport(**options)


def _websocket_tls(**options: Any) -> Transport:
    cert, key = make_self_signed(HOST)
    return WebSocketTransport(tls=TlsSettings(cert, key, ca=cert), **options)


def _quic(**options: Any) -> Transport:
    return QuicTransport(**options)


def _tcp(**options: Any) -> Transport:
    return TcpTransport(**options)


#: Every transport the conformance suite runs on; wss verifies a self-signed certificate.
ALL_TRANSPORTS = [
    pytest.param(_websocket, id="websocket"),
    pytest.param(_websocket_tls, id="websocket-tls"),
    pytest.param(_quic, id="quic"),
    pytest.param(_tcp, id="tcp"),
]
#: One of each protocol, for suites where TLS adds nothing.
EACH_PROTOCOL = [ALL_TRANSPORTS[0], ALL_TRANSPORTS[2]]


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run ``coro`` on a fresh event loop, failing the test if it takes over ``timeout``."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


class Served:
    """A listener whose handler hands each accepted connection to the test and keeps it open
    until the test ends (a connection is closed when its handler returns)."""

    def __init__(self) -> None:
        self.accepted: asyncio.Queue[Connection] = asyncio.Queue()
        self.handler_tasks: list[asyncio.Task[Any]] = []
        self.release = asyncio.Event()
        self.listener: Listener | None = None

    async def handler(self, conn: Connection) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handler_tasks.append(task)
        await self.accepted.put(conn)
        await self.release.wait()

    @property
    def port(self) -> int:
        assert self.listener is not None
        return self.listener.port


def trust(*conns: Connection) -> None:
    """Lift the pre-authentication limits, as a successful authentication exchange would:
    these tests exercise the transport itself, so they skip the exchange."""
    for conn in conns:
        conn.authenticated()


@contextlib.asynccontextmanager
async def serving(
    transport: Transport, handler: Callable[[Connection], Awaitable[None]] | None = None
) -> AsyncIterator[Served]:
    """Listen on an ephemeral loopback port with :class:`Served`'s handler (or ``handler``)."""
    served = Served()
    served.listener = await transport.listen(HOST, 0, handler or served.handler)
    try:
        yield served
    finally:
        served.release.set()
        await served.listener.close()


@contextlib.asynccontextmanager
async def connected(
    server_transport: Transport, client_transport: Transport | None = None
) -> AsyncIterator[tuple[Connection, Connection, Served]]:
    """A connected ``(client, server, served)``, both :func:`trust`-ed; everything is closed
    on exit."""
    async with serving(server_transport) as served:
        client = await (client_transport or server_transport).connect(HOST, served.port)
        try:
            server = await asyncio.wait_for(served.accepted.get(), 10)
            trust(client, server)
            yield client, server, served
        finally:
            await client.close()


def free_port(kind: socket.SocketKind) -> int:
    """A loopback port with nothing bound to it (just released by the kernel)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port
