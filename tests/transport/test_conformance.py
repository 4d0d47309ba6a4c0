"""The transport contract (``burncoll/transport/base.py``), checked on every transport.

Real sockets on 127.0.0.1 with ephemeral ports. Every async body runs under a deadline, so a
transport that hangs fails the test instead of stalling the suite.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import random
import socket
import time

import pytest

from burncoll.errors import ProtocolError, TransportError
from burncoll.transport.base import Buffer, Connection

from .support import (
    ALL_TRANSPORTS,
    HOST,
    MakeTransport,
    connected,
    free_port,
    run,
    serving,
    trust,
)

pytestmark = pytest.mark.parametrize("make", ALL_TRANSPORTS)

MiB = 1024 * 1024
#: The transports' default ``close_timeout``: a close waits at most that for the other side.
CLOSE_TIMEOUT = 2.0
#: How long a peer may take to notice a close: twice the close's own bound (room for a loaded
#: machine; a close that hung would take the recv's 10 s).
PROMPT = 2 * CLOSE_TIMEOUT


async def _recv_within(conn: Connection, seconds: float = 10.0) -> Buffer:
    async with asyncio.timeout(seconds):
        return await conn.recv()


async def _expect_recv_error(conn: Connection, seconds: float = PROMPT) -> TransportError:
    """``conn.recv()`` must raise TransportError within ``seconds``; returns the error."""
    with pytest.raises(TransportError) as info:
        await _recv_within(conn, seconds)
    return info.value


def test_connect_reports_both_ends(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, server, served):
            assert served.port > 0
            assert client.remote == f"{HOST}:{served.port}"
            host, _, port = server.remote.rpartition(":")
            assert host == HOST and int(port) > 0

    run(body())


def test_messages_of_every_size_arrive_whole_and_in_order(make: MakeTransport) -> None:
    sizes = [0, 1, MiB, 64 * MiB]
    payloads = [random.randbytes(n) for n in sizes]

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            for payload in payloads:
                await client.send([payload])
            for payload in payloads:
                got = await _recv_within(server, 60)
                assert len(got) == len(payload) and got == payload
            for payload in payloads[:3]:  # and back
                await server.send([payload])
            for payload in payloads[:3]:
                assert await _recv_within(client) == payload

    run(body(), timeout=90)


def test_a_message_of_several_parts_arrives_joined(make: MakeTransport) -> None:
    floats = array.array("d", [1.5, -2.0, 3.25])  # a buffer whose items are 8 bytes
    big = random.randbytes(300_000)
    messages: list[list[Buffer]] = [
        [b"head", bytearray(b"-mid-"), memoryview(b"tail")],
        [b"", b"x", b""],
        [],
        [b"header" * 10, memoryview(floats), big, b"", memoryview(big)[:1000]],
        [b"strided:", memoryview(big)[::3], memoryview(floats)[::2]],  # not contiguous
    ]

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            for parts in messages:
                await client.send(parts)
            for parts in messages:
                expected = b"".join(memoryview(p).tobytes() for p in parts)
                assert await _recv_within(server) == expected

    run(body())


def test_many_concurrent_connections_to_one_listener(make: MakeTransport) -> None:
    async def echo(conn: Connection) -> None:
        trust(conn)
        while True:
            message = await conn.recv()
            await conn.send([b"echo:", message])

    async def body() -> None:
        transport = make()
        async with serving(transport, echo) as served:

            async def one(i: int) -> None:
                conn = await transport.connect(HOST, served.port)
                trust(conn)
                try:
                    for round_ in range(3):
                        payload = f"{i}/{round_}".encode() * (i + 1)
                        await conn.send([payload])
                        assert await _recv_within(conn) == b"echo:" + payload
                finally:
                    await conn.close()

            # as many as one source may have waiting to authenticate at once (more are
            # evicted oldest first: tests/transport/test_admission.py)
            await asyncio.gather(*(one(i) for i in range(16)))

    run(body())


def test_concurrent_sends_on_one_connection_keep_messages_intact(make: MakeTransport) -> None:
    senders, per_sender = 6, 15

    async def body() -> None:
        async with connected(make()) as (client, server, _):

            async def send_all(sender: int) -> None:
                for i in range(per_sender):
                    size = (i * 37_001) % 200_000  # small and large (fragmented) messages
                    tag = bytes([sender]) + i.to_bytes(2, "little")
                    await client.send([tag, bytes([sender]) * size])
                    if i % 4 == 0:
                        await asyncio.sleep(0)

            await asyncio.gather(*(send_all(s) for s in range(senders)))
            seen: dict[int, list[int]] = {s: [] for s in range(senders)}
            for _ in range(senders * per_sender):
                message = bytes(await _recv_within(server))
                sender, i = message[0], int.from_bytes(message[1:3], "little")
                assert message[3:] == bytes([sender]) * ((i * 37_001) % 200_000)
                seen[sender].append(i)
            assert all(order == list(range(per_sender)) for order in seen.values())

    run(body())


@pytest.mark.parametrize("closer", ["client", "server"])
def test_close_makes_the_other_side_recv_raise_promptly(make: MakeTransport, closer: str) -> None:
    async def body() -> None:
        async with connected(make()) as (client, server, _):
            closing, other = (client, server) if closer == "client" else (server, client)
            pending = asyncio.create_task(_recv_within(other))
            await asyncio.sleep(0.05)
            await closing.send([b"last words"])
            started = time.monotonic()
            await closing.close()
            await closing.close()  # idempotent
            assert await pending == b"last words"  # what was sent before close arrives
            await _expect_recv_error(other)
            assert time.monotonic() - started < PROMPT
            with pytest.raises(TransportError):
                await closing.send([b"after close"])
            await _expect_recv_error(closing)
            with pytest.raises(TransportError):
                await other.send([b"to a closed peer"])

    run(body())


def test_close_fails_a_pending_recv_on_the_same_side(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, _server, _):
            pending = asyncio.create_task(_expect_recv_error(client))
            await asyncio.sleep(0.05)
            await client.close()
            await pending

    run(body())


def test_listener_close_makes_client_recv_raise(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, _server, served):
            pending = asyncio.create_task(_expect_recv_error(client))
            await asyncio.sleep(0.05)
            assert served.listener is not None
            await served.listener.close()
            await served.listener.close()  # idempotent
            await pending

    run(body())


def test_cancelled_handler_makes_client_recv_raise(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, _server, served):
            pending = asyncio.create_task(_expect_recv_error(client))
            await asyncio.sleep(0.05)
            served.handler_tasks[0].cancel()
            await pending

    run(body())


def test_connect_to_a_port_nobody_listens_on_raises(make: MakeTransport) -> None:
    async def body() -> None:
        transport = make(connect_timeout=5.0)
        kind = socket.SOCK_DGRAM if transport.name == "quic" else socket.SOCK_STREAM
        port = free_port(kind)
        with pytest.raises(TransportError, match=str(port)):
            async with asyncio.timeout(8):
                await transport.connect(HOST, port)

    run(body())


def test_listen_on_a_port_in_use_raises_naming_it(make: MakeTransport) -> None:
    async def body() -> None:
        transport = make()
        async with serving(transport) as served:
            with pytest.raises(TransportError, match=f"{HOST}:{served.port}"):
                await transport.listen(HOST, served.port, served.handler)

    run(body())


def test_message_over_the_limit_fails_both_sides_without_hanging(make: MakeTransport) -> None:
    limit = 64 * 1024

    async def body() -> None:
        receiver, sender = make(max_message_bytes=limit), make()
        async with connected(receiver, sender) as (client, server, _):
            await client.send([bytes(limit)])  # exactly the limit: accepted
            assert len(await _recv_within(server)) == limit
            await client.send([b"x", bytes(limit)])
            with pytest.raises(ProtocolError):
                await _recv_within(server, PROMPT)
            error = await _expect_recv_error(client)
            assert isinstance(error, TransportError)

    run(body())


def test_close_is_bounded_when_the_peer_never_reads(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make(close_timeout=CLOSE_TIMEOUT / 4)) as (client, _server, _):

            async def flood() -> None:
                for _ in range(12_000):  # ~47 MiB: more than every buffer on the way holds
                    await client.send([bytes(4096)])

            flooding = asyncio.create_task(flood())
            await asyncio.sleep(0.5)
            started = time.monotonic()
            await client.close()
            assert time.monotonic() - started < PROMPT  # (the flood would block it for ever)
            with contextlib.suppress(TransportError):  # a send blocked by then fails
                await flooding

    run(body())
