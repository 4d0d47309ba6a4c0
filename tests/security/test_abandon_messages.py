"""Who may fail a forming collective with an ``abandon`` message, and with what.

An ``abandon`` (a node that failed before it could join) fails the nodes waiting with its
fingerprint at once. Only a connection that authenticated may send one (with a token: only the
job's processes); its reason is bounded; it fails only the group of its own fingerprint. Real
orchestrator, real clients, real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

import burncoll
from burncoll.errors import AuthenticationError
from burncoll.node.orchestrator_client import OrchestratorClient
from burncoll.protocol.control import MAX_REASON, Join
from burncoll.protocol.wire import encode_control
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client

HOST = "127.0.0.1"
TOKEN = "abandon test token, long enough"
FINGERPRINT = {"num_nodes": 2, "transport": "websocket"}
#: The waiting node's timeout: a session that forms does so long before it.
SECONDS = 20.0


def join(peer: int) -> Join:
    return Join(HOST, 40000 + peer, (peer,), FINGERPRINT)


async def register(port: int, peer: int) -> OrchestratorClient:
    client = OrchestratorClient(get_transport("websocket"), HOST, port, TOKEN, SECONDS)
    await client.join(join(peer), time.monotonic() + SECONDS)
    return client


async def send_abandon(port: int, token: str, **changes: Any) -> None:
    """A raw connection that authenticates with ``token`` and says ``abandon``."""
    message = {"type": "abandon", "node": 1, "peer_ids": [1], "fingerprint": FINGERPRINT,
               "error": "ConfigError", "reason": "node 1 broke", "pid": 1, **changes}
    conn = await get_transport("websocket").connect(HOST, port)
    try:
        conn = await authenticate_client(conn, token, 5.0)
        await conn.send([encode_control(message)])
        await asyncio.sleep(0.3)  # the orchestrator has read it
    finally:
        await conn.close()


def forms_despite(abandon: dict[str, Any], token: str = TOKEN) -> list[int]:
    """Node 0 waits; ``abandon`` is sent; node 1 joins: the indexes of the session formed."""
    with burncoll.start_orchestrator(auth_token=TOKEN) as orch:
        async def scenario() -> list[int]:
            first = asyncio.ensure_future(register(orch.port, 0))
            await asyncio.sleep(0.3)
            with contextlib.suppress(AuthenticationError):  # refused at the door
                await send_abandon(orch.port, token, **abandon)
            clients = list(await asyncio.gather(first, register(orch.port, 1)))
            for client in clients:
                await client.close()
            return [c.index for c in clients]

        return asyncio.run(scenario())


def waiting_fails(abandon: dict[str, Any]) -> BaseException:
    """Node 0 waits; ``abandon`` is sent with the token: what node 0 raises (within half its
    timeout)."""
    with burncoll.start_orchestrator(auth_token=TOKEN) as orch:
        async def scenario() -> BaseException:
            first = asyncio.ensure_future(register(orch.port, 0))
            await asyncio.sleep(0.3)
            await send_abandon(orch.port, TOKEN, **abandon)
            with pytest.raises(burncoll.CollectiveError) as info:
                await asyncio.wait_for(first, SECONDS / 2)
            return info.value

        return asyncio.run(scenario())


def test_an_abandon_from_a_job_process_fails_the_waiting_node() -> None:
    error = waiting_fails({})
    assert isinstance(error, burncoll.ConfigError), repr(error)
    assert "node 1 (peer ids [1], pid 1) failed before" in str(error), error
    assert str(error).endswith("node 1 broke"), error


def test_an_error_name_not_ours_arrives_as_a_plain_collective_error() -> None:
    assert type(waiting_fails({"error": "SystemExit"})) is burncoll.CollectiveError


@pytest.mark.parametrize("abandon", [
    {"reason": "x" * (MAX_REASON + 1)},              # longer than any reason may be
    {"fingerprint": {**FINGERPRINT, "num_nodes": 3}},  # another collective's
], ids=["too-long", "other-fingerprint"])
def test_what_an_abandon_cannot_do(abandon: dict[str, Any]) -> None:
    assert forms_despite(abandon) == [0, 1]


def test_a_stranger_without_the_token_cannot_fail_a_forming_collective() -> None:
    assert forms_despite({}, token="not the token, but long enough") == [0, 1]
