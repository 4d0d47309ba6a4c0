"""The shared-token challenge-response (``burncoll/transport/auth.py``) over real transports."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from burncoll.errors import AuthenticationError
from burncoll.ops import OpKind
from burncoll.protocol.wire import DataHeader, decode, encode_control, encode_data_header
from burncoll.transport.auth import authenticate_client, authenticate_server
from burncoll.transport.base import Connection

from .support import EACH_PROTOCOL, HOST, MakeTransport, run, serving

pytestmark = pytest.mark.parametrize("make", EACH_PROTOCOL)

#: A failed authentication must be reported faster than this (no timeouts involved): well
#: under TIMEOUT, with room for a loaded machine (the suite runs two workers on two cores).
QUICK = 8.0
TIMEOUT = 20.0

ServerSide = Callable[[Connection], Awaitable[Any]]
ClientSide = Callable[[Connection], Awaitable[Any]]


async def _exchange(
    make: MakeTransport, server_side: ServerSide, client_side: ClientSide
) -> tuple[BaseException | Any, BaseException | Any, float]:
    """Run ``server_side`` in the listener's handler and ``client_side`` on a connection.

    Returns what each returned or raised, and how long the two took together.
    """
    transport = make()
    server_result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def handler(conn: Connection) -> None:
        try:
            server_result.set_result(await server_side(conn))
        except Exception as exc:
            server_result.set_result(exc)

    async with serving(transport, handler) as served:
        conn = await transport.connect(HOST, served.port)
        started = time.monotonic()
        try:
            try:
                client_result: Any = await client_side(conn)
            except Exception as exc:
                client_result = exc
            server_outcome = await asyncio.wait_for(server_result, TIMEOUT + 2)
        finally:
            await conn.close()
        return server_outcome, client_result, time.monotonic() - started


def _server(token: str | None, timeout: float = TIMEOUT) -> ServerSide:
    return lambda conn: authenticate_server(conn, token, timeout)


def _client(token: str | None, timeout: float = TIMEOUT) -> ClientSide:
    return lambda conn: authenticate_client(conn, token, timeout)


@pytest.mark.parametrize("token", ["s3cret", "ünïcødé token", None])
def test_the_same_token_passes_both_ways(make: MakeTransport, token: str | None) -> None:
    async def server_then_echo(conn: Connection) -> bytes:
        await authenticate_server(conn, token, TIMEOUT)
        message = bytes(await conn.recv())
        await conn.send([message])
        return message

    async def client_then_send(conn: Connection) -> bytes:
        await authenticate_client(conn, token, TIMEOUT)
        await conn.send([b"data after auth"])
        return bytes(await conn.recv())

    server, client, _ = run(_exchange(make, server_then_echo, client_then_send))
    assert server == client == b"data after auth"


@pytest.mark.parametrize(
    ("server_token", "client_token", "server_says", "client_says"),
    [("right", "wrong", "presented a wrong auth token", "(wrong auth token): the node and the "
                                                        "orchestrator were given different"),
     ("token", "token ", "presented a wrong auth token", "given different auth tokens"),
     # a side without a token is told so, and which side lacks it
     (None, "token", "presented an auth token and this side has none",
      "(unexpected auth token): it has no auth token and this process has one"),
     ("token", None, "connected without an auth token and this side requires one",
      "(no auth token): it requires an auth token and this process has none")],
)
def test_different_tokens_fail_on_both_sides_quickly(
    make: MakeTransport, server_token: str | None, client_token: str | None, server_says: str,
    client_says: str,
) -> None:
    server, client, elapsed = run(_exchange(make, _server(server_token), _client(client_token)))
    assert isinstance(server, AuthenticationError), server
    assert isinstance(client, AuthenticationError), client
    assert server_says in str(server) and client_says in str(client), (server, client)
    assert "BURNCOLL_AUTH_TOKEN" in str(client) and "BURNCOLL_AUTH_TOKEN" in str(server)
    assert elapsed < QUICK


def test_garbage_instead_of_a_response_fails_the_server_quickly(make: MakeTransport) -> None:
    async def garbage(conn: Connection) -> bytes:
        await conn.recv()  # the challenge
        await conn.send([b"GET / HTTP/1.1\r\n\r\n"])
        return bytes(await conn.recv())  # the server says why

    server, client, elapsed = run(_exchange(make, _server("token"), garbage))
    assert isinstance(server, AuthenticationError) and "malformed" in str(server)
    assert isinstance(client, bytes)
    denial = decode(client).control
    assert denial is not None and denial["type"] == "denied" and "malformed" in denial["reason"]
    assert elapsed < QUICK


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(encode_control({"type": "response", "nonce": "00", "mac": "00"}), id="short"),
        pytest.param(encode_control({"type": "hello"}), id="wrong-type"),
        pytest.param(
            encode_data_header(
                DataHeader(1, 1, OpKind.BARRIER, None, None, (), -1, 0, 0, 0, 0, 0, 0), 0
            ),
            id="array-data",
        ),
    ],
)
def test_a_malformed_response_fails_the_server(make: MakeTransport, reply: bytes) -> None:
    async def send_reply(conn: Connection) -> None:
        await conn.recv()
        await conn.send([reply])

    server, _, elapsed = run(_exchange(make, _server("token"), send_reply))
    assert isinstance(server, AuthenticationError)
    assert elapsed < QUICK


def test_a_silent_client_times_out_the_server(make: MakeTransport) -> None:
    async def silent(conn: Connection) -> None:
        await conn.recv()
        await asyncio.sleep(1.0)

    server, _, elapsed = run(_exchange(make, _server("token", timeout=0.3), silent))
    assert isinstance(server, AuthenticationError) and "within 0.3 s" in str(server)
    assert elapsed < QUICK


def test_a_silent_server_times_out_the_client(make: MakeTransport) -> None:
    async def silent(conn: Connection) -> None:
        await asyncio.sleep(1.0)

    _, client, _ = run(_exchange(make, silent, _client("token", timeout=0.3)))
    assert isinstance(client, AuthenticationError) and "within 0.3 s" in str(client)


def test_a_server_without_the_token_is_caught_by_the_client(make: MakeTransport) -> None:
    """An impostor that accepts every response still cannot forge the welcome proof."""

    async def impostor(conn: Connection) -> None:
        nonce = bytes(32)
        await conn.send([encode_control(
            {"type": "challenge", "nonce": nonce.hex(), "version": 2, "integrity": False})])
        response = decode(await conn.recv()).control
        assert response is not None
        # Replaying the client's own MAC as the proof must not work either.
        await conn.send([encode_control({"type": "welcome", "mac": response["mac"]})])

    _, client, _ = run(_exchange(make, impostor, _client("token")))
    assert isinstance(client, AuthenticationError) and "prove" in str(client)


def test_a_server_of_another_version_is_reported(make: MakeTransport) -> None:
    async def future_server(conn: Connection) -> None:
        challenge = {"type": "challenge", "nonce": bytes(32).hex(), "version": 99}
        await conn.send([encode_control(challenge)])
        await asyncio.sleep(0.5)

    _, client, _ = run(_exchange(make, future_server, _client("token")))
    assert isinstance(client, AuthenticationError) and "version" in str(client)


def test_the_client_mac_follows_the_documented_formula(make: MakeTransport) -> None:
    """HMAC-SHA256(token, b"burncoll-auth-v2 client|Ns|Nc|B|F"), hex; B is empty without TLS,
    F empty without integrity."""
    server_nonce = bytes(range(32))

    async def recorder(conn: Connection) -> dict[str, Any]:
        binding = conn.channel_binding()
        await conn.send([encode_control({"type": "challenge", "nonce": server_nonce.hex(),
                                         "version": 2, "integrity": False})])
        response = decode(await conn.recv()).control
        assert response is not None
        await conn.send([encode_control({"type": "denied", "reason": "recorded"})])
        return {"response": response, "binding": binding}

    recorded, client, _ = run(_exchange(make, recorder, _client("token")))
    assert isinstance(recorded, dict)
    response, binding = recorded["response"], recorded["binding"]
    client_nonce = bytes.fromhex(response["nonce"])
    message = b"|".join((b"burncoll-auth-v2 client", server_nonce, client_nonce, binding, b""))
    expected = hmac.new(b"token", message, hashlib.sha256).hexdigest()
    assert response["mac"] == expected and len(client_nonce) == 32
    assert isinstance(client, AuthenticationError) and "recorded" in str(client)
