"""The zero-copy writer shares its transport's descriptor: a plain connection holds one
descriptor per end (issue 32), and still sends array-sized messages both ways at once while its
transport reads on the same descriptor."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from burncoll.transport.base import Connection
from tests.transport.support import (
    ALL_TRANSPORTS,
    HOST,
    MakeTransport,
    connected,
    run,
    serving,
    trust,
)

PLAIN = [p for p in ALL_TRANSPORTS if p.id in ("tcp", "websocket")]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("make", PLAIN)
def test_a_plain_connection_holds_one_descriptor_per_end(make: MakeTransport) -> None:
    async def body() -> None:
        transport = make()
        async with serving(transport) as served:
            before = _open_fds()
            client = await transport.connect(HOST, served.port)
            server = await asyncio.wait_for(served.accepted.get(), 10)
            trust(client, server)
            assert _open_fds() - before == 2  # the client's socket and the accepted one
            big = np.arange(1 << 20, dtype=np.float64).tobytes()
            await client.send([big])  # through the writer
            assert len(await asyncio.wait_for(server.recv(), 10)) == 8 << 20
            await client.close()
            await server.close()
            await asyncio.sleep(0.1)  # the server's transport closes on the next turns
            assert _open_fds() == before

    run(body())


@pytest.mark.parametrize("make", PLAIN)
def test_large_messages_cross_both_ways_at_once(make: MakeTransport) -> None:
    """Each end sends 4 x 16 MiB while it receives as much: the writer waits for the shared
    descriptor to drain while the transport reads on it; every byte arrives in order."""
    rng = np.random.default_rng(32)
    arrays = [rng.standard_normal(2 << 20) for _ in range(8)]

    async def pump(conn: Connection, mine: list[np.ndarray], theirs: list[np.ndarray]) -> None:
        async def send() -> None:
            for array in mine:
                await conn.send([array.tobytes()])

        async def receive() -> None:
            for array in theirs:
                got = np.frombuffer(memoryview(await conn.recv()), dtype=np.float64)  # type: ignore[arg-type]
                np.testing.assert_array_equal(got, array)

        await asyncio.gather(send(), receive())

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            await asyncio.wait_for(asyncio.gather(pump(client, arrays[:4], arrays[4:]),
                                                  pump(server, arrays[4:], arrays[:4])), 60)

    run(body(), timeout=90)
