"""A stream connection's receive scratch buffer grows only when a frame needs it (issue 32: two
256 KiB buffers per other node were most of a node's resident growth at 64 node processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from burncoll.transport.base import PREAUTH_BYTES, Connection
from burncoll.transport.stream import JOIN_BYTES, SCRATCH_BYTES
from tests.transport.support import ALL_TRANSPORTS, MakeTransport, connected, run

STREAMS = [p for p in ALL_TRANSPORTS if p.id in ("tcp", "websocket", "websocket-tls")]


def _scratch_bytes(conn: Connection) -> int:
    return len(conn._protocol._scratch)  # type: ignore[attr-defined]


async def _exchange(client: Connection, server: Connection, sizes: list[int]) -> None:
    """Send a message of each size (random float64 bytes); each arrives whole and in order."""
    rng = np.random.default_rng(len(sizes))
    messages = [rng.standard_normal(size // 8).tobytes() for size in sizes]
    for message in messages:
        await client.send([message])
    for message in messages:
        got = await asyncio.wait_for(server.recv(), 10)
        assert bytes(got) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("make", STREAMS)
def test_small_frames_never_grow_the_scratch_buffer(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, server, _):
            await _exchange(client, server, [8, 64, 1024, 4096] * 250)
            assert _scratch_bytes(server) == PREAUTH_BYTES
            await _exchange(client, server, [8 << 20])  # past JOIN_BYTES: its own buffer
            assert _scratch_bytes(server) == PREAUTH_BYTES

    run(body())


@pytest.mark.parametrize("make", STREAMS)
def test_a_frame_larger_than_the_scratch_buffer_grows_it(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, server, _):
            await _exchange(client, server, [PREAUTH_BYTES * 2, 8, JOIN_BYTES, 8, JOIN_BYTES])
            assert PREAUTH_BYTES < _scratch_bytes(server) <= SCRATCH_BYTES

    run(body())
