"""Authentication that a relay cannot pass: the channel binding over TLS, per-message integrity
without it (``burncoll/transport/auth.py``, ``burncoll/transport/integrity.py``).

The relay is a real man in the middle on 127.0.0.1: a listener of the same transport, with a
certificate of its own where there is TLS, that dials the real listener and forwards every
message unchanged in both directions -- the challenge-response included -- and, once the
exchange is over, may flip a byte of the array data. It holds no token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from burncoll.errors import AuthenticationError, CollectiveError, ProtocolError
from burncoll.transport.auth import authenticate_client, authenticate_server
from burncoll.transport.base import Connection, TlsSettings, Transport
from burncoll.transport.quic import QuicTransport
from burncoll.transport.tcp import TcpTransport
from burncoll.transport.tls import make_self_signed
from burncoll.transport.websocket import WebSocketTransport

from .support import HOST, run

TOKEN = "a token of more than sixteen bytes"
TIMEOUT = 5.0
#: Messages the connecting side sends in the challenge-response (its response).
_CLIENT_AUTH_MESSAGES = 1


def _relay_tls() -> TlsSettings:
    """The relay's own certificate: it does not have the listener's private key."""
    cert, key = make_self_signed("relay.invalid")
    return TlsSettings(cert, key)


#: ``(real transport, relay's listening transport, relay's dialing transport)`` per mode.
MODES: dict[str, Callable[[], tuple[Transport, Transport, Transport]]] = {
    "quic": lambda: (QuicTransport(), QuicTransport(tls=_relay_tls()), QuicTransport()),
    "wss-ephemeral": lambda: (
        WebSocketTransport(tls=TlsSettings(ephemeral=True)),
        WebSocketTransport(tls=_relay_tls()),
        WebSocketTransport(tls=TlsSettings(ephemeral=True)),
    ),
    "ws": lambda: (WebSocketTransport(), WebSocketTransport(), WebSocketTransport()),
    "tcp": lambda: (TcpTransport(), TcpTransport(), TcpTransport()),
}


async def _pump(src: Connection, dst: Connection, flip_after: int | None) -> None:
    """Forward messages ``src`` -> ``dst``; flip one byte of the first message after
    ``flip_after`` messages (``None``: never)."""
    count = 0
    with contextlib.suppress(CollectiveError):
        while True:
            message = bytearray(bytes(await src.recv()))
            if flip_after is not None and count >= flip_after and len(message) > 100:
                message[-5] ^= 0x40
                flip_after = None
            count += 1
            await dst.send([message])


async def _session(modes: tuple[Transport, Transport, Transport], integrity: bool,
                   flip: bool, via_relay: bool = True) -> tuple[Any, Any]:
    """A listener that authenticates and then echoes one message; a client that reaches it
    (through the relay unless ``via_relay`` is false), authenticates, sends 1 KiB and reads
    the echo. Returns what each side returned or raised."""
    real, relay_listen, relay_dial = modes
    server_outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def serve(conn: Connection) -> None:
        try:
            secured = await authenticate_server(conn, TOKEN, TIMEOUT, integrity=integrity)
            message = bytes(await secured.recv())
            await secured.send([message])
            server_outcome.set_result(message)
        except CollectiveError as exc:
            server_outcome.set_result(exc)

    listener = await real.listen(HOST, 0, serve)
    tasks: list[asyncio.Task[None]] = []

    async def relay(client_side: Connection) -> None:
        server_side = await relay_dial.connect(HOST, listener.port)
        pumps = [asyncio.ensure_future(_pump(client_side, server_side,
                                             _CLIENT_AUTH_MESSAGES if flip else None)),
                 asyncio.ensure_future(_pump(server_side, client_side, None))]
        tasks.extend(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        await server_side.close()

    relay_listener = await relay_listen.listen(HOST, 0, relay)
    port = relay_listener.port if via_relay else listener.port
    conn = await relay_dial.connect(HOST, port)
    payload = bytes(range(256)) * 4
    try:
        secured = await authenticate_client(conn, TOKEN, TIMEOUT, integrity=integrity)
        await secured.send([payload])
        client: Any = bytes(await asyncio.wait_for(secured.recv(), TIMEOUT))
    except CollectiveError as exc:
        client = exc
    try:
        server = await asyncio.wait_for(server_outcome, TIMEOUT)
    except TimeoutError:
        server = "no outcome"
    await conn.close()
    for task in tasks:
        task.cancel()
    await relay_listener.close()
    await listener.close()
    return server, client


@pytest.mark.parametrize("mode", ["quic", "wss-ephemeral"])
def test_a_relay_that_terminates_tls_cannot_authenticate(mode: str) -> None:
    server, client = run(_session(MODES[mode](), integrity=False, flip=False))
    assert isinstance(server, AuthenticationError), server
    assert isinstance(client, AuthenticationError), client
    assert "relay" in str(server) and "relay" in str(client)


@pytest.mark.parametrize("mode", ["quic", "wss-ephemeral"])
def test_without_a_relay_the_binding_agrees(mode: str) -> None:
    server, client = run(_session(MODES[mode](), integrity=False, flip=False, via_relay=False))
    payload = bytes(range(256)) * 4
    assert server == payload and client == payload


@pytest.mark.parametrize("mode", ["ws", "tcp", "quic", "wss-ephemeral"])
def test_integrity_passes_unaltered_messages(mode: str) -> None:
    server, client = run(_session(MODES[mode](), integrity=True, flip=False, via_relay=False))
    payload = bytes(range(256)) * 4
    assert server == payload and client == payload


@pytest.mark.parametrize("mode", ["ws", "tcp"])
def test_integrity_catches_a_relay_that_alters_data(mode: str) -> None:
    server, client = run(_session(MODES[mode](), integrity=True, flip=True))
    assert isinstance(server, ProtocolError) and "integrity check" in str(server), server
    assert not isinstance(client, bytes)  # the server never echoed: no altered result


@pytest.mark.parametrize("mode", ["ws", "tcp"])
def test_plain_connections_without_integrity_do_not_protect_against_a_relay(mode: str) -> None:
    """The documented unprotected mode: the relay passes the exchange and alters the data."""
    server, client = run(_session(MODES[mode](), integrity=False, flip=True))
    assert isinstance(server, bytes) and server != bytes(range(256)) * 4
    assert client == server  # the altered bytes, and nobody noticed


@pytest.mark.parametrize("server_side", [True, False])
def test_both_ends_must_agree_on_integrity(server_side: bool) -> None:
    async def scenario() -> tuple[Any, Any]:
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def serve(conn: Connection) -> None:
            try:
                outcome.set_result(await authenticate_server(conn, TOKEN, TIMEOUT,
                                                             integrity=server_side))
            except CollectiveError as exc:
                outcome.set_result(exc)

        transport = TcpTransport()
        listener = await transport.listen(HOST, 0, serve)
        conn = await transport.connect(HOST, listener.port)
        try:
            client: Any = await authenticate_client(conn, TOKEN, TIMEOUT,
                                                    integrity=not server_side)
        except CollectiveError as exc:
            client = exc
        await conn.close()
        server = await asyncio.wait_for(outcome, TIMEOUT)
        await listener.close()
        return server, client

    server, client = run(scenario())
    assert isinstance(client, AuthenticationError) and "integrity" in str(client), client
    assert not isinstance(server, Connection)
