"""``FastPath.send_now``: a peer thread sends a small message itself, beside the event loop.

Messages written from another thread and from the loop on the same connection must arrive
whole, each sender's in its own order; connections that cannot send plainly (a masking
WebSocket client, TLS) must refuse so that the caller uses the loop, and those without the
fast path at all (QUIC, integrity-tagged ones) must not claim it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from burncoll.transport.base import FastPath
from burncoll.transport.integrity import IntegrityConnection
from tests.transport.support import ALL_TRANSPORTS, MakeTransport, connected, run

#: Which side of a connection may send without the loop, per transport.
PLAIN = {"websocket": {"server"}, "websocket-tls": set(), "quic": set(), "tcp": {"server",
                                                                                 "client"}}


def _message(sender: str, k: int) -> bytes:
    body = f"{sender}:{k}:".encode()
    return body + bytes(k % 700)  # sizes from a few bytes to ~700


@pytest.mark.parametrize("make", ALL_TRANSPORTS)
def test_only_plain_connections_send_now(make: MakeTransport,
                                         request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.id

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            for side, conn, other in (("client", client, server), ("server", server, client)):
                assert isinstance(conn, FastPath) == (name != "quic"), (name, side)
                took = isinstance(conn, FastPath) and conn.send_now([b"hello ", b"there"])
                assert took == (side in PLAIN[name]), (name, side)
                if took:
                    assert bytes(await asyncio.wait_for(other.recv(), 5)) == b"hello there"

    run(body())


@pytest.mark.parametrize("make", [ALL_TRANSPORTS[0], ALL_TRANSPORTS[3]])
def test_a_thread_and_the_loop_interleave_whole_messages(make: MakeTransport) -> None:
    count = 400

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            sender = server  # a WebSocket server sends plainly
            assert isinstance(sender, FastPath)
            refused: list[int] = []

            def from_thread() -> None:
                for k in range(count):
                    if not sender.send_now([_message("thread", k)]):
                        refused.append(k)

            thread = threading.Thread(target=from_thread)
            thread.start()
            for k in range(count):  # the loop sends too, some messages large
                await sender.send([_message("loop", k), bytes(70_000 if k % 50 == 0 else 0)])
                if k % 10 == 0:
                    await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            for k in refused:  # the thread's fallback: through the loop, as a caller does
                await sender.send([_message("thread", k)])
            seen: dict[str, list[int]] = {"thread": [], "loop": []}
            for _ in range(2 * count):
                data = bytes(await asyncio.wait_for(client.recv(), 10))
                who, k, _rest = data.split(b":", 2)
                index = int(k)
                expected = _message(who.decode(), index)
                extra = 70_000 if who == b"loop" and index % 50 == 0 else 0
                assert data == expected + bytes(extra), (who, index)
                seen[who.decode()].append(index)
            assert seen["loop"] == list(range(count))
            direct = [k for k in seen["thread"] if k not in refused]
            assert direct == sorted(direct) and sorted(seen["thread"]) == list(range(count))

    run(body(), timeout=60)



@pytest.mark.parametrize("make", [ALL_TRANSPORTS[0], ALL_TRANSPORTS[3]])
def test_an_integrity_tagged_connection_has_no_fast_path(make: MakeTransport) -> None:
    """Its messages must leave from the loop, in tag order, and be checked before use."""

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            assert isinstance(client, FastPath) and isinstance(server, FastPath)
            tagged = IntegrityConnection(client, send_key=b"k" * 32, recv_key=b"k" * 32)
            assert not isinstance(tagged, FastPath)

    run(body())
