"""burncoll's WebSocket framing against the ``websockets`` library, both ways round.

The library is an independent RFC 6455 implementation: if its client and server exchange
messages of every length encoding (7-, 16- and 64-bit), fragmented messages, pings and close
codes with ours, our handshake, masking and framing follow the RFC.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.base import Connection
from burncoll.transport.websocket import WebSocketTransport
from burncoll.transport.ws_frames import frame_header, mask_in_place
from tests.transport.support import HOST, run

#: One payload per length encoding, and either side of each boundary.
SIZES = [0, 1, 125, 126, 65535, 65536, 3 * 1024 * 1024 + 7]


async def _echo(conn: Connection) -> None:
    conn.authenticated()  # these tests exercise the framing, not the authentication
    try:
        while True:
            await conn.send([await conn.recv()])
    except TransportError:
        pass


def test_the_websockets_client_talks_to_a_burncoll_listener() -> None:
    async def body() -> None:
        listener = await WebSocketTransport().listen(HOST, 0, _echo)
        try:
            async with ws_connect(f"ws://{HOST}:{listener.port}/", max_size=None,
                                  compression=None) as ws:
                for size in SIZES:
                    payload = os.urandom(size)
                    await ws.send(payload)
                    assert await ws.recv() == payload
                # a fragmented message is joined
                parts = [os.urandom(n) for n in (10, 70_000, 3)]
                await ws.send(parts)
                assert await ws.recv() == b"".join(parts)
                pong = await ws.ping(b"are you there")
                await asyncio.wait_for(pong, 5)
                # text is not burncoll's: refused with 1003 (unsupported data)
                await ws.send("text")
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003
        finally:
            await listener.close()

    run(body())


def test_a_burncoll_client_talks_to_the_websockets_server() -> None:
    async def echo(ws: ServerConnection) -> None:
        async for message in ws:
            await ws.send(message)

    async def body() -> None:
        async with ws_serve(echo, HOST, 0, max_size=None, compression=None) as server:
            port = server.sockets[0].getsockname()[1]
            conn = await WebSocketTransport().connect(HOST, port)
            conn.authenticated()
            try:
                for size in SIZES:
                    payload = os.urandom(size)
                    await conn.send([payload[: size // 3], payload[size // 3:]])
                    assert bytes(await asyncio.wait_for(conn.recv(), 10)) == payload
            finally:
                await conn.close()

    run(body())


def test_a_server_message_over_the_limit_closes_with_1009() -> None:
    async def flood(ws: ServerConnection) -> None:
        await ws.send(bytes(2048))
        await ws.wait_closed()  # the client closes with 1009

    async def body() -> None:
        async with ws_serve(flood, HOST, 0, compression=None) as server:
            port = server.sockets[0].getsockname()[1]
            conn = await WebSocketTransport(max_message_bytes=1024).connect(HOST, port)
            try:
                with pytest.raises(ProtocolError, match="exceeds the size limit"):
                    await asyncio.wait_for(conn.recv(), 5)
            finally:
                await conn.close()

    run(body())


def test_masking_is_its_own_inverse_and_matches_the_rfc_example() -> None:
    # RFC 6455 section 5.7: "Hello" masked with 37 fa 21 3d
    data = memoryview(bytearray(b"Hello"))
    mask_in_place(data, bytes.fromhex("37fa213d"))
    assert bytes(data) == bytes.fromhex("7f9f4d5158")
    assert frame_header(0x1, 5, bytes.fromhex("37fa213d")) == bytes.fromhex("818537fa213d")
    long = memoryview(bytearray(os.urandom(1001)))
    original = bytes(long)
    key = os.urandom(4)
    mask_in_place(long, key)
    expected: Any = bytes(b ^ key[i % 4] for i, b in enumerate(original))
    assert bytes(long) == expected
    mask_in_place(long, key)
    assert bytes(long) == original
