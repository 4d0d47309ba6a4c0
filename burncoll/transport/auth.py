"""Mutual challenge-response authentication with a shared token; the token never travels.

Runs first on every connection (orchestrator and data service), before any array byte is
read. Three CONTROL frames (:mod:`burncoll.transport.wire`)::

    server -> client  {"type": "challenge", "nonce": hex(Ns), "version": 1}
    client -> server  {"type": "response", "nonce": hex(Nc), "mac": hex(HMAC(K, L + Ns + Nc))}
    server -> client  {"type": "welcome", "mac": hex(HMAC(K, L' + Nc + Ns))}
                  or  {"type": "denied", "reason": "..."}

``K`` is the token's UTF-8 bytes, empty when no token is configured (so a process without a
token and one with a token fail to authenticate each other instead of silently agreeing);
``Ns``/``Nc`` are 32 fresh random bytes each; HMAC is HMAC-SHA256 (RFC 2104). ``L`` is
``b"burncoll-auth-v1"`` and ``L'`` is ``b"burncoll-auth-v1 server"``: distinct labels, so the
server's proof can never be replayed as a client's response or the other way round. Fresh
nonces on both sides defeat replays; digests are compared in constant time.

This authenticates the *peers*, not the channel: without TLS verification (``ca``) an active
man-in-the-middle could relay the exchange and then read or alter the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from typing import Any

from burncoll.errors import AuthenticationError, ProtocolError, TransportError
from burncoll.transport.base import Connection
from burncoll.transport.wire import FrameType, decode, encode_control

__all__ = ["AUTH_MESSAGE_LIMIT", "AUTH_VERSION", "authenticate_client", "authenticate_server"]

AUTH_VERSION = 1
#: Largest message accepted from a side that has not authenticated yet.
AUTH_MESSAGE_LIMIT = 64 * 1024
_CLIENT_LABEL = b"burncoll-auth-v1"
_SERVER_LABEL = b"burncoll-auth-v1 server"
_NONCE_BYTES = 32
_WRONG_TOKEN = "wrong auth token"
_MISMATCH_HINT = (
    "the node and the orchestrator were given different auth tokens; set the same "
    "BURNCOLL_AUTH_TOKEN on every node and on the orchestrator"
)


def _mac(token: str | None, label: bytes, first: bytes, second: bytes) -> str:
    key = (token or "").encode("utf-8")
    return hmac.new(key, label + first + second, hashlib.sha256).hexdigest()


async def _recv_control(conn: Connection, expected: tuple[str, ...]) -> dict[str, Any]:
    """The next message, which must be a CONTROL frame of one of the ``expected`` types."""
    frame = decode(await conn.recv())
    message = frame.control
    if frame.frame_type != FrameType.CONTROL or message is None:
        raise ProtocolError("expected an authentication message, got array data")
    if message["type"] not in expected:
        raise ProtocolError(f"expected {' or '.join(expected)}, got {message['type']!r}")
    return message


async def _send_control(conn: Connection, message: dict[str, Any]) -> None:
    await conn.send([encode_control(message)])


def _nonce(message: dict[str, Any]) -> bytes:
    value = message.get("nonce")
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != _NONCE_BYTES:
        raise ProtocolError(f"{message['type']} carries no valid {_NONCE_BYTES}-byte nonce")
    return nonce


def _mac_matches(message: dict[str, Any], expected: str) -> bool:
    mac = message.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(mac.encode(), expected.encode())


async def authenticate_server(conn: Connection, token: str | None, timeout: float) -> None:
    """Challenge the side that connected; return once it proved it holds ``token``.

    Raises :class:`~burncoll.AuthenticationError` for a wrong token, a malformed or
    unexpected reply, or no reply within ``timeout`` seconds; a ``denied`` message is sent
    first, so the other side fails at once. The caller then logs and closes ``conn``.
    :class:`~burncoll.TransportError` propagates when the connection breaks.
    """
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    conn.limit_incoming(AUTH_MESSAGE_LIMIT)  # a stranger may not make this side allocate much
    try:
        async with asyncio.timeout(timeout):
            challenge = {"type": "challenge", "nonce": server_nonce.hex(), "version": AUTH_VERSION}
            await _send_control(conn, challenge)
            try:
                reply = await _recv_control(conn, ("response",))
                client_nonce = _nonce(reply)
            except ProtocolError as exc:
                await _deny(conn, f"malformed authentication reply: {exc}")
                raise AuthenticationError(
                    f"{conn.remote} sent a malformed authentication reply: {exc}"
                ) from exc
            if not _mac_matches(reply, _mac(token, _CLIENT_LABEL, server_nonce, client_nonce)):
                await _deny(conn, _WRONG_TOKEN)
                raise AuthenticationError(
                    f"{conn.remote} presented a wrong auth token; {_MISMATCH_HINT}"
                )
            proof = _mac(token, _SERVER_LABEL, client_nonce, server_nonce)
            conn.limit_incoming(None)
            await _send_control(conn, {"type": "welcome", "mac": proof})
    except TimeoutError as exc:
        raise AuthenticationError(
            f"{conn.remote} did not complete authentication within {timeout:g} s"
        ) from exc


async def _deny(conn: Connection, reason: str) -> None:
    """Tell the client why it is refused; a broken connection is no reason for another error."""
    with contextlib.suppress(TransportError):
        await _send_control(conn, {"type": "denied", "reason": reason})


async def authenticate_client(conn: Connection, token: str | None, timeout: float) -> None:
    """Answer the server's challenge with ``token`` and check the server's own proof.

    Raises :class:`~burncoll.AuthenticationError` when the server refuses the token, cannot
    prove it holds the same token, speaks another protocol or version, or does not finish
    within ``timeout`` seconds. :class:`~burncoll.TransportError` propagates when the
    connection breaks.
    """
    try:
        async with asyncio.timeout(timeout):
            challenge = await _recv_control(conn, ("challenge", "denied"))
            if challenge["type"] == "denied":
                raise _denied(conn, challenge)
            if challenge.get("version") != AUTH_VERSION:
                raise AuthenticationError(
                    f"{conn.remote} speaks authentication version {challenge.get('version')!r}"
                    f", this process {AUTH_VERSION}: run the same burncoll version everywhere"
                )
            server_nonce = _nonce(challenge)
            client_nonce = secrets.token_bytes(_NONCE_BYTES)
            mac = _mac(token, _CLIENT_LABEL, server_nonce, client_nonce)
            await _send_control(conn, {"type": "response", "nonce": client_nonce.hex(), "mac": mac})
            verdict = await _recv_control(conn, ("welcome", "denied"))
    except TimeoutError as exc:
        raise AuthenticationError(
            f"{conn.remote} did not complete authentication within {timeout:g} s"
        ) from exc
    except ProtocolError as exc:
        raise AuthenticationError(
            f"{conn.remote} is not a burncoll endpoint of this version: {exc}"
        ) from exc
    if verdict["type"] == "denied":
        raise _denied(conn, verdict)
    if not _mac_matches(verdict, _mac(token, _SERVER_LABEL, client_nonce, server_nonce)):
        raise AuthenticationError(
            f"{conn.remote} could not prove it holds the auth token: {_MISMATCH_HINT}"
        )


def _denied(conn: Connection, message: dict[str, Any]) -> AuthenticationError:
    reason = str(message.get("reason", "no reason given"))[:200]
    hint = f": {_MISMATCH_HINT}" if reason == _WRONG_TOKEN else ""
    return AuthenticationError(f"{conn.remote} refused this connection ({reason}){hint}")
