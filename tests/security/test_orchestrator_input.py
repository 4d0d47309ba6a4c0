"""The orchestrator against malformed input from clients that hold the token.

A join message the orchestrator cannot use is refused with a reason and leaves no trace: it
must not wait among the pending nodes and spoil the next joins (a ``num_nodes`` of ``"x"``
used to stay in the waiting list after a ValueError, and every later node was refused as
"config differs"). A waiting node that sends a malformed frame is dropped with a logged
reason. Real orchestrator, real transports on 127.0.0.1, in this process.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import burncoll
from burncoll.protocol.wire import decode, encode_control
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client
from burncoll.transport.base import Connection

from .hostile import malformed

TOKEN = "orchestrator test token"
HOST = "127.0.0.1"

pytestmark = pytest.mark.parametrize("transport", ["websocket", "quic"])


def join(peer: int, **changes: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "type": "join",
        "host": HOST,
        "port": 40000 + peer,
        "peer_ids": [peer],
        "fingerprint": {"num_nodes": 2, "transport": "test"},
    }
    message.update(changes)
    return message


async def connect(transport: str, port: int) -> Connection:
    conn = await get_transport(transport).connect(HOST, port)
    await authenticate_client(conn, TOKEN, 5.0)
    return conn


async def ask(transport: str, port: int, message: dict[str, Any]) -> dict[str, Any]:
    """Send one join; the orchestrator's reply."""
    conn = await connect(transport, port)
    try:
        await conn.send([encode_control(message)])
        async with asyncio.timeout(5.0):
            reply = decode(await conn.recv()).control
    finally:
        await conn.close()
    assert reply is not None
    return reply


MALFORMED_JOINS = [
    join(9, fingerprint={"num_nodes": "x"}),
    join(9, fingerprint={"num_nodes": 0}),
    join(9, fingerprint={"num_nodes": True}),
    join(9, fingerprint="not an object"),
    join(9, port="80"),
    join(9, port=70000),
    join(9, host=7),
    join(9, peer_ids=[]),
    join(9, peer_ids=[-1]),
    join(9, peer_ids=[3, 3]),
    join(9, peer_ids=["0"]),
]


def test_a_malformed_join_is_refused_and_spoils_nothing(transport: str) -> None:
    with burncoll.start_orchestrator(transport=transport, auth_token=TOKEN) as orch:

        async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            refused = [await ask(transport, orch.port, m) for m in MALFORMED_JOINS]
            tables = await asyncio.gather(
                ask(transport, orch.port, join(0)), ask(transport, orch.port, join(1))
            )
            return refused, list(tables)

        refused, tables = asyncio.run(scenario())
    for message, reply in zip(MALFORMED_JOINS, refused, strict=True):
        assert reply["type"] == "refused", (message, reply)
        assert reply["reason"].startswith("malformed join message: "), (message, reply)
    # The two good nodes form a session of their own: nothing malformed was kept waiting.
    assert [t["type"] for t in tables] == ["table", "table"], tables
    assert [n["peer_ids"] for n in tables[0]["nodes"]] == [[0], [1]], tables


def test_a_waiting_node_that_sends_a_malformed_frame_is_dropped_with_a_reason(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="burncoll.orchestrator"),
        burncoll.start_orchestrator(transport=transport, auth_token=TOKEN) as orch,
    ):

        async def scenario() -> list[dict[str, Any]]:
            waiting = await connect(transport, orch.port)
            await waiting.send([encode_control(join(5))])
            await waiting.send([malformed("version")])
            async with asyncio.timeout(5.0):
                with pytest.raises(burncoll.TransportError):
                    while True:  # dropped: the connection ends
                        await waiting.recv()
            await waiting.close()
            # The dropped node no longer waits: two new nodes form a session without it.
            return list(
                await asyncio.gather(
                    ask(transport, orch.port, join(0)), ask(transport, orch.port, join(1))
                )
            )

        tables = asyncio.run(scenario())
    assert [t["type"] for t in tables] == ["table", "table"], tables
    assert [n["peer_ids"] for n in tables[0]["nodes"]] == [[0], [1]], tables
    dropped = [r.getMessage() for r in caplog.records if "malformed frame" in r.getMessage()]
    assert dropped and "wire version 99" in dropped[0], caplog.text
