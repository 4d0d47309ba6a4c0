"""Transports: how nodes and the orchestrator exchange messages (see :mod:`.base`).

:func:`get_transport` turns the config's spelling (``"websocket"``, ``"quic"``, ``"tcp"``) into a
:class:`Transport`. The implementations are imported on first use, so a missing optional
dependency (aioquic for QUIC) is reported only to those who ask for that transport.
"""

from __future__ import annotations

from collections.abc import Callable

from burncoll.errors import ConfigError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.base import Connection, Listener, TlsSettings, Transport

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TRANSPORT_NAMES",
    "Connection",
    "Listener",
    "TlsSettings",
    "Transport",
    "get_transport",
]


def _websocket(tls: TlsSettings | None, max_message_bytes: int) -> Transport:
    from burncoll.transport.websocket import WebSocketTransport

    return WebSocketTransport(tls=tls, max_message_bytes=max_message_bytes)


def _quic(tls: TlsSettings | None, max_message_bytes: int) -> Transport:
    try:
        from burncoll.transport.quic import QuicTransport
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in ("aioquic", "cryptography"):
            raise
        raise ConfigError(
            f"transport 'quic' needs {exc.name}, which is not installed: "
            "pip install 'burncoll[quic]' (or choose transport 'websocket')"
        ) from exc
    return QuicTransport(tls=tls, max_message_bytes=max_message_bytes)


def _tcp(tls: TlsSettings | None, max_message_bytes: int) -> Transport:
    from burncoll.transport.tcp import TcpTransport

    if tls is not None and tls.wanted:
        raise ConfigError(
            "transport 'tcp' has no TLS: choose transport 'websocket' (wss) or 'quic' to use "
            "the TLS settings"
        )
    return TcpTransport(max_message_bytes=max_message_bytes)


#: Transport name -> factory ``(tls, max_message_bytes) -> Transport``.
_FACTORIES: dict[str, Callable[[TlsSettings | None, int], Transport]] = {
    "websocket": _websocket,
    "quic": _quic,
    "tcp": _tcp,
}
#: The names :func:`get_transport` accepts.
TRANSPORT_NAMES = tuple(_FACTORIES)


def get_transport(
    name: str,
    *,
    tls: TlsSettings | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Transport:
    """The transport called ``name`` (``"websocket"`` or ``"quic"``).

    ``tls``: ``None`` means plain WebSocket, and for QUIC (always encrypted) an ephemeral
    self-signed certificate; see :mod:`burncoll.transport.tls`. ``max_message_bytes`` bounds
    every incoming message.

    Raises :class:`~burncoll.ConfigError` for an unknown name (listing the choices), a
    non-positive ``max_message_bytes``, or a transport whose library is not installed (naming
    the extra to install).
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        choices = ", ".join(repr(n) for n in TRANSPORT_NAMES)
        raise ConfigError(f"unknown transport {name!r}; choose one of {choices}")
    if max_message_bytes <= 0:
        raise ConfigError(f"max_message_bytes must be positive, not {max_message_bytes}")
    return factory(tls, max_message_bytes)
