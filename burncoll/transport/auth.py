"""Mutual challenge-response authentication with a shared token, bound to the channel.

Runs first on every connection, before any array byte is read (docs/security.md)::

    server -> client  {"type": "challenge", "nonce": hex(Ns), "version": 2, "integrity": I,
                       "token": T}
    client -> server  {"type": "response", "nonce": hex(Nc), "mac": hex(HMAC(K, Lc|Ns|Nc|B|F)),
                       "token": T}
    server -> client  {"type": "welcome", "mac": hex(HMAC(K, Ls|Nc|Ns|B|F))}  or  "denied"

``K``: the token's UTF-8 bytes (empty without one, so a side with a token and one without
fail instead of agreeing); ``Ns``/``Nc``: 32 fresh random bytes (no replay); ``Lc``/``Ls``:
distinct labels (a server proof is never a client response); HMAC-SHA256, compared in constant
time. ``T`` (outside the MAC) only picks the error message. ``B``: the RFC 5929
``tls-server-end-point`` channel binding (``Connection.channel_binding``; empty without
TLS), so a relay terminating TLS with its own certificate fails the exchange (Python's
``ssl`` exposes no keying-material exporter). ``F``: ``b"integrity"`` when every later
message carries a tag keyed from ``K``, both nonces and ``B``
(:mod:`burncoll.transport.integrity`); in the MAC, so a relay cannot switch it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from typing import Any

from burncoll.errors import AuthenticationError, ProtocolError, TransportError
from burncoll.protocol.wire import FrameType, decode, encode_control
from burncoll.transport.base import PREAUTH_SECONDS, Connection
from burncoll.transport.integrity import IntegrityConnection, derive_keys

__all__ = ["AUTH_VERSION", "authenticate_client", "authenticate_server"]

AUTH_VERSION = 2
_CLIENT_LABEL = b"burncoll-auth-v2 client"
_SERVER_LABEL = b"burncoll-auth-v2 server"
_INTEGRITY_FLAG = b"integrity"
_NONCE_BYTES = 32
_WRONG_TOKEN = "wrong auth token"
_NO_TOKEN = "no auth token"
_UNEXPECTED_TOKEN = "unexpected auth token"
_HOW_TO_SET = ("BURNCOLL_AUTH_TOKEN=<token> or BURNCOLL_AUTH_TOKEN_FILE=<path> in the "
               "environment, auth_token_file in the config, or `burncoll orchestrator "
               "--auth-token-file PATH`")
#: What the side that connected is told, by the reason it was refused for.
_HINTS = {
    _NO_TOKEN: "it requires an auth token and this process has none: set here the token the "
               f"orchestrator and the other nodes have ({_HOW_TO_SET})",
    _UNEXPECTED_TOKEN: "it has no auth token and this process has one: give it the same token "
                       f"({_HOW_TO_SET}), or run every node and the orchestrator without one",
}
_MISMATCH_HINT = ("the node and the orchestrator were given different auth tokens; set the same "
                  "BURNCOLL_AUTH_TOKEN on every node and on the orchestrator")
_RELAY_HINT = (
    "; or a relay between the two ends terminated TLS (the certificate this side received "
    "is not the one the listener presents)"
)


def _mac(token: str | None, label: bytes, first: bytes, second: bytes, binding: bytes,
         integrity: bool) -> str:
    key = (token or "").encode("utf-8")
    flags = _INTEGRITY_FLAG if integrity else b""
    message = b"|".join((label, first, second, binding, flags))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


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


def _secured(conn: Connection, token: str | None, server_nonce: bytes, client_nonce: bytes,
             binding: bytes, integrity: bool, server: bool) -> Connection:
    """The connection to use after a successful exchange: ``conn`` itself, or ``conn`` with a
    tag on every message when ``integrity`` is on."""
    conn.authenticated()
    if not integrity:
        return conn
    to_client, to_server = derive_keys((token or "").encode("utf-8"), server_nonce,
                                       client_nonce, binding)
    if server:
        return IntegrityConnection(conn, send_key=to_client, recv_key=to_server)
    return IntegrityConnection(conn, send_key=to_server, recv_key=to_client)


async def authenticate_server(conn: Connection, token: str | None, timeout: float, *,
                              integrity: bool = False) -> Connection:
    """Challenge the side that connected; return the connection to use once it proved it holds
    ``token`` over this very channel (tagged when ``integrity``). Waits at most ``min(timeout,
    PREAUTH_SECONDS)``. Raises :class:`~burncoll.AuthenticationError` (after sending ``denied``) for
    a wrong token, a relay, a malformed reply or none in time; :class:`~burncoll.TransportError`
    when the connection breaks. The caller closes ``conn``."""
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    binding = conn.channel_binding()
    limit = min(timeout, PREAUTH_SECONDS)
    try:
        async with asyncio.timeout(limit):
            await _send_control(conn, {"type": "challenge", "nonce": server_nonce.hex(),
                                       "version": AUTH_VERSION, "integrity": integrity,
                                       "token": token is not None})
            try:
                reply = await _recv_control(conn, ("response",))
                client_nonce = _nonce(reply)
            except ProtocolError as exc:
                await _deny(conn, f"malformed authentication reply: {exc}")
                raise AuthenticationError(
                    f"{conn.remote} sent a malformed authentication reply: {exc}"
                ) from exc
            expected = _mac(token, _CLIENT_LABEL, server_nonce, client_nonce, binding, integrity)
            if not _mac_matches(reply, expected):
                raise await _refuse(conn, token, reply.get("token"), binding)
            proof = _mac(token, _SERVER_LABEL, client_nonce, server_nonce, binding, integrity)
            await _send_control(conn, {"type": "welcome", "mac": proof})
    except TimeoutError as exc:
        raise AuthenticationError(
            f"{conn.remote} did not complete authentication within {limit:g} s"
        ) from exc
    return _secured(conn, token, server_nonce, client_nonce, binding, integrity, server=True)


async def _refuse(conn: Connection, token: str | None, theirs: object, binding: bytes
                  ) -> AuthenticationError:
    """Deny a client whose proof did not match, saying whether it lacks a token, has one where
    this side has none, or has another; the error to raise here."""
    if token is not None and theirs is False:
        await _deny(conn, _NO_TOKEN)
        return AuthenticationError(
            f"{conn.remote} connected without an auth token and this side requires one: set "
            f"there the token the orchestrator and the other nodes have ({_HOW_TO_SET})")
    if token is None and theirs is True:
        await _deny(conn, _UNEXPECTED_TOKEN)
        return AuthenticationError(
            f"{conn.remote} presented an auth token and this side has none: give this side "
            f"the same token ({_HOW_TO_SET}), or run every node without one")
    await _deny(conn, _WRONG_TOKEN)
    return AuthenticationError(f"{conn.remote} presented a wrong auth token; {_MISMATCH_HINT}"
                               + (_RELAY_HINT if binding else ""))


async def _deny(conn: Connection, reason: str) -> None:
    """Tell the client why it is refused; a broken connection is no reason for another error."""
    with contextlib.suppress(TransportError):
        await _send_control(conn, {"type": "denied", "reason": reason})


async def authenticate_client(conn: Connection, token: str | None, timeout: float, *,
                              integrity: bool = False) -> Connection:
    """Answer the server's challenge with ``token`` and check the server's own proof; return the
    connection to use from then on. Raises :class:`~burncoll.AuthenticationError` when the server
    refuses, cannot prove the token, wants another ``integrity`` or version, or does not finish
    within ``timeout`` seconds; :class:`~burncoll.TransportError` when the connection breaks."""
    binding = conn.channel_binding()
    try:
        async with asyncio.timeout(timeout):
            challenge = await _recv_control(conn, ("challenge", "denied"))
            if challenge["type"] == "denied":
                raise _denied(conn, challenge)
            _check_challenge(conn, challenge, integrity)
            server_nonce = _nonce(challenge)
            client_nonce = secrets.token_bytes(_NONCE_BYTES)
            mac = _mac(token, _CLIENT_LABEL, server_nonce, client_nonce, binding, integrity)
            await _send_control(conn, {"type": "response", "nonce": client_nonce.hex(),
                                       "mac": mac, "token": token is not None})
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
        raise _denied(conn, verdict, binding)
    expected = _mac(token, _SERVER_LABEL, client_nonce, server_nonce, binding, integrity)
    if not _mac_matches(verdict, expected):
        raise AuthenticationError(
            f"{conn.remote} could not prove it holds the auth token: {_MISMATCH_HINT}"
            + (_RELAY_HINT if binding else "")
        )
    return _secured(conn, token, server_nonce, client_nonce, binding, integrity, server=False)


def _check_challenge(conn: Connection, challenge: dict[str, Any], integrity: bool) -> None:
    if challenge.get("version") != AUTH_VERSION:
        raise AuthenticationError(
            f"{conn.remote} speaks authentication version {challenge.get('version')!r}"
            f", this process {AUTH_VERSION}: run the same burncoll version everywhere"
        )
    wanted = challenge.get("integrity")
    if wanted is not integrity:
        raise AuthenticationError(
            f"{conn.remote} runs with integrity={wanted!r}, this process with "
            f"integrity={integrity}: set the same `integrity` on every node and on the "
            "orchestrator"
        )


def _denied(conn: Connection, message: dict[str, Any], binding: bytes = b""
            ) -> AuthenticationError:
    reason = str(message.get("reason", "no reason given"))[:200]
    hint = f": {_HINTS[reason]}" if reason in _HINTS else ""
    if reason == _WRONG_TOKEN:
        hint = f": {_MISMATCH_HINT}" + (_RELAY_HINT if binding else "")
    return AuthenticationError(f"{conn.remote} refused this connection ({reason}){hint}")
