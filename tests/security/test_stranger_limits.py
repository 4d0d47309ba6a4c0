"""A peer cannot make a listener grow without bound or hold a connection forever: over
WebSocket pings are not answered while earlier bytes wait to leave and a message may not come
in unlimited empty fragments, even after authentication (before it, tighter limits hold:
tests/transport/test_preauth_stream.py); a TCP listener drops a connection that never sends
its preamble."""

from __future__ import annotations

import asyncio
import os

from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from burncoll.errors import TransportError
from burncoll.transport.tcp import TcpTransport
from burncoll.transport.websocket import MAX_FRAGMENTS, WebSocketTransport
from burncoll.transport.ws_frames import frame_header
from tests.transport.support import HOST, run, serving


def _masked(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    key = os.urandom(4)
    body = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return frame_header(opcode, len(payload), key, fin=fin) + body


async def _upgraded(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    client = ClientProtocol(parse_uri(f"ws://{HOST}:{port}/"))
    client.send_request(client.connect())
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"".join(client.data_to_send()))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def test_a_ping_flood_from_a_peer_that_never_reads_queues_almost_nothing() -> None:
    async def body() -> None:
        async with serving(WebSocketTransport()) as served:
            _reader, writer = await _upgraded(served.port)
            conn = await asyncio.wait_for(served.accepted.get(), 5)
            conn.authenticated()  # the limits after authentication (before it: 16 KiB in all)
            ping = _masked(0x9, bytes(125))
            for _ in range(100):
                writer.write(ping * 2000)  # 200,000 pings of 125 bytes, never reading
                await writer.drain()
            await asyncio.sleep(0.5)
            backlog = conn._protocol._write_backlog()  # type: ignore[attr-defined]
            assert backlog < 1 << 20, backlog  # 25 MB of pings: at most a few pongs queued
            writer.close()

    run(body())


def test_a_message_in_too_many_fragments_is_refused() -> None:
    async def body() -> None:
        async with serving(WebSocketTransport()) as served:
            reader, writer = await _upgraded(served.port)
            conn = await asyncio.wait_for(served.accepted.get(), 5)
            conn.authenticated()  # the limits after authentication (before it: 4 fragments)
            writer.write(_masked(0x2, b"x", fin=False))
            writer.write(_masked(0x0, b"", fin=False) * (MAX_FRAGMENTS + 10))
            await writer.drain()
            try:
                await asyncio.wait_for(conn.recv(), 5)
            except TransportError as exc:  # ProtocolError, raised by recv
                assert "fragments" in str(exc), exc
            else:
                raise AssertionError("the fragmented flood was delivered")
            closing = await asyncio.wait_for(reader.read(), 5)  # the close frame, then EOF
            assert closing[:2] == b"\x88\x12" or b"too many fragments" in closing, closing
            writer.close()

    run(body())


def test_a_silent_stranger_is_dropped_by_a_tcp_listener() -> None:
    async def body() -> None:
        async with serving(TcpTransport(connect_timeout=0.3)) as served:
            reader, writer = await asyncio.open_connection(HOST, served.port)
            # says nothing: the listener closes the connection after connect_timeout
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()

    run(body())
