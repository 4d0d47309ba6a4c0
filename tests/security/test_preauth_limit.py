"""Before it authenticates, a stranger cannot make a listener accept a large message."""

from __future__ import annotations

import asyncio

import pytest

from burncoll.errors import AuthenticationError, TransportError
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_server
from burncoll.transport.base import PREAUTH_BYTES, Connection


@pytest.mark.parametrize("name", ["websocket", "quic", "tcp"])
def test_a_large_message_before_authentication_is_refused(name: str) -> None:
    async def scenario() -> BaseException | None:
        transport = get_transport(name)
        outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        async def handler(conn: Connection) -> None:
            try:
                await authenticate_server(conn, "token", timeout=5.0)
                outcome.set_result(None)
            except (AuthenticationError, TransportError) as exc:
                outcome.set_result(exc)

        listener = await transport.listen("127.0.0.1", 0, handler)
        try:
            client = await transport.connect("127.0.0.1", listener.port)
            await client.recv()  # the challenge
            await client.send([b"\0" * (PREAUTH_BYTES + 1024)])  # too big, and not a reply
            async with asyncio.timeout(5.0):
                result = await outcome
            await client.close()
            return result
        finally:
            await listener.close()

    result = asyncio.run(scenario())
    assert isinstance(result, (AuthenticationError, TransportError)), result
    # refused for its size (the pre-authentication limit), not merely for being garbage
    assert str(PREAUTH_BYTES) in str(result) and "limit" in str(result), result
