"""Mutual challenge-response authentication with a shared token; the token never travels.

Runs first on every connection, before any array byte is read::

    server -> client  {"type": "challenge", "nonce": Ns, "version": 1}
    client -> server  {"type": "response", "nonce": Nc, "mac": HMAC(K, L + Ns + Nc)}
    server -> client  {"type": "welcome", "mac": HMAC(K, L + Nc + Ns)}   (or "denied")

with ``K`` the token (empty when none is configured, so a node without a token cannot join a
collective that has one), ``L`` a fixed label, nonces of 32 random bytes and HMAC-SHA256.
The server proves it knows the token too, so a client never talks to an impostor.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Any

from burncoll.errors import AuthenticationError, ProtocolError
from burncoll.transport.base import Connection
from burncoll.transport.wire import FrameType, decode, encode_control

__all__ = ["authenticate_client", "authenticate_server"]

_LABEL = b"burncoll-auth-v1"
_VERSION = 1


def _mac(token: str | None, first: bytes, second: bytes) -> str:
    key = (token or "").encode()
    return hmac.new(key, _LABEL + first + second, hashlib.sha256).hexdigest()


async def _recv_control(conn: Connection, expected: tuple[str, ...]) -> dict[str, Any]:
    frame = decode(await conn.recv())
    message = frame.control
    if frame.frame_type != FrameType.CONTROL or message is None:
        raise ProtocolError("expected an authentication message, got array data")
    if message["type"] not in expected:
        raise ProtocolError(f"expected {' or '.join(expected)}, got {message['type']!r}")
    return message


def _nonce(message: dict[str, Any]) -> bytes:
    value = message.get("nonce")
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != 32:
        raise ProtocolError("authentication message carries no valid nonce")
    return nonce


async def authenticate_server(conn: Connection, token: str | None, timeout: float) -> None:
    """Challenge the connecting side; raise :class:`AuthenticationError` if it fails.

    On failure a ``denied`` message is sent first, so the other side fails at once.
    """
    server_nonce = secrets.token_bytes(32)
    try:
        async with asyncio.timeout(timeout):
            await conn.send([encode_control(
                {"type": "challenge", "nonce": server_nonce.hex(), "version": _VERSION})])
            reply = await _recv_control(conn, ("response",))
            client_nonce = _nonce(reply)
            expected = _mac(token, server_nonce, client_nonce)
            if not hmac.compare_digest(str(reply.get("mac", "")), expected):
                await conn.send([encode_control(
                    {"type": "denied", "reason": "wrong auth token"})])
                raise AuthenticationError(f"{conn.remote} presented a wrong auth token")
            await conn.send([encode_control(
                {"type": "welcome", "mac": _mac(token, client_nonce, server_nonce)})])
    except TimeoutError:
        raise AuthenticationError(
            f"{conn.remote} did not complete authentication within {timeout:g} s") from None
    except ProtocolError as exc:
        raise AuthenticationError(f"{conn.remote} failed authentication: {exc}") from exc


async def authenticate_client(conn: Connection, token: str | None, timeout: float) -> None:
    """Answer the server's challenge and check its proof; raise AuthenticationError."""
    hint = (
        "the nodes and the orchestrator were given different auth tokens; set the same "
        "BURNCOLL_AUTH_TOKEN (or auth_token) everywhere"
    )
    try:
        async with asyncio.timeout(timeout):
            challenge = await _recv_control(conn, ("challenge",))
            server_nonce = _nonce(challenge)
            client_nonce = secrets.token_bytes(32)
            await conn.send([encode_control({
                "type": "response", "nonce": client_nonce.hex(),
                "mac": _mac(token, server_nonce, client_nonce),
            })])
            verdict = await _recv_control(conn, ("welcome", "denied"))
    except TimeoutError:
        raise AuthenticationError(
            f"{conn.remote} did not complete authentication within {timeout:g} s") from None
    except ProtocolError as exc:
        raise AuthenticationError(f"{conn.remote} is not a burncoll endpoint: {exc}") from exc
    if verdict["type"] == "denied":
        raise AuthenticationError(f"{conn.remote} refused this connection: {hint}")
    if not hmac.compare_digest(str(verdict.get("mac", "")),
                               _mac(token, client_nonce, server_nonce)):
        raise AuthenticationError(f"{conn.remote} could not prove it knows the token: {hint}")
