"""QUIC transport (RFC 9000) on aioquic's asyncio API; always TLS 1.3, ALPN ``burncoll``.

A connection is one QUIC connection carrying one bidirectional stream of length-prefixed
messages (:mod:`burncoll.transport.quic_connection`). Until it is authenticated the other side
gets :data:`~burncoll.transport.base.PREAUTH_BYTES` of flow-control credit and nothing larger
is allocated on its word (:mod:`burncoll.transport.quic_connection`); listeners screen handshakes
(:mod:`burncoll.transport.quic_server`). A silent peer is declared gone after
``idle_timeout`` (pings every third of it keep a live one open); a client's UDP socket is
connected, so an ICMP "port unreachable" fails it at once. Throughput: aioquic's defaults give
about 30 MB/s; 16 KiB datagrams (IP fragments them on a LAN; lower ``max_datagram_size`` where
fragments are dropped), ``2 * max_message_bytes`` windows and larger socket buffers lift that
several times over.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography.hazmat.primitives.serialization import Encoding

from burncoll.errors import ConfigError, TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.admission import Admission
from burncoll.transport.base import PREAUTH_SECONDS, Handler, TlsSettings, Transport, format_address
from burncoll.transport.quic_connection import (
    PREAMBLE,
    PREAUTH_WINDOW,
    GatedConnection,
    QuicProtocol,
    QuicStreamConnection,
)
from burncoll.transport.quic_server import (
    HANDSHAKE_SECONDS,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    RETRY_HANDSHAKES,
    GuardedServer,
    QuicListener,
)
from burncoll.transport.tls import (
    binding_of_certificate,
    configure_quic_client,
    configure_quic_server,
    listener_binding,
)

__all__ = ["ALPN", "MAX_DATAGRAM_SIZE", "QuicTransport"]

ALPN = "burncoll"
#: aioquic writes a STREAM frame's length as a 2-byte varint (at most 16383) and silently
#: truncates longer ones, so a datagram must not carry more: larger ones lose data.
MAX_DATAGRAM_SIZE = 16384
_SOCKET_BUFFER = 8 * 1024 * 1024


@dataclass(kw_only=True, eq=False)
class QuicTransport(Transport):
    """Listen and connect with QUIC.

    Args:
        tls: certificates (:mod:`burncoll.transport.tls`); ``None``: an ephemeral self-signed one
            that clients do not verify.
        max_message_bytes: the largest message this side accepts.
        max_datagram_size: the largest UDP payload sent, 1200 to :data:`MAX_DATAGRAM_SIZE`.
        congestion_control: ``"reno"`` or ``"cubic"``.
        connect_timeout: seconds for the QUIC handshake.
        close_timeout: seconds ``close`` waits for the peer to acknowledge what was sent.
        idle_timeout: seconds of silence after which a peer is declared gone.
        preauth_seconds: a listener drops a connection not authenticated this long after its
            first packet.
        max_handshakes, max_handshakes_per_source, retry_handshakes: a listener's handshake caps
            (:mod:`burncoll.transport.quic_server`).
        max_connections, max_pending, max_pending_per_source: a listener's
            :class:`~burncoll.transport.admission.Admission` caps.
    """

    name = "quic"
    tls: TlsSettings | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_datagram_size: int = MAX_DATAGRAM_SIZE
    congestion_control: str = "reno"
    connect_timeout: float = 10.0
    close_timeout: float = 2.0
    idle_timeout: float = 30.0
    preauth_seconds: float = PREAUTH_SECONDS
    max_handshakes: int = MAX_HANDSHAKES
    retry_handshakes: int = RETRY_HANDSHAKES
    max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE
    max_connections: int = 1024
    max_pending: int = 64
    max_pending_per_source: int = 16

    def __post_init__(self) -> None:
        max_handshakes, retry_handshakes = self.max_handshakes, self.retry_handshakes
        if not 1200 <= self.max_datagram_size <= MAX_DATAGRAM_SIZE:
            raise ConfigError(f"max_datagram_size must be in [1200, {MAX_DATAGRAM_SIZE}], not "
                              f"{self.max_datagram_size}")
        if not 0 <= retry_handshakes <= max_handshakes or max_handshakes < 1:
            raise ConfigError(
                "QUIC needs 0 <= retry_handshakes <= max_handshakes and max_handshakes >= 1, "
                f"not retry_handshakes={retry_handshakes}, max_handshakes={max_handshakes}"
            )
        if not 1 <= self.max_handshakes_per_source <= max_handshakes:
            raise ConfigError("QUIC needs 1 <= max_handshakes_per_source <= max_handshakes, not "
                              f"max_handshakes_per_source={self.max_handshakes_per_source}, "
                              f"max_handshakes={max_handshakes}")

    def _configuration(self, is_client: bool) -> QuicConfiguration:
        # The initial credit is the pre-authentication one; authenticated() opens the window.
        return QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN],
                                 congestion_control_algorithm=self.congestion_control,
                                 idle_timeout=self.idle_timeout,
                                 max_datagram_size=self.max_datagram_size, max_data=PREAUTH_WINDOW,
                                 max_stream_data=PREAUTH_WINDOW)

    def _protocol_factory(self, **kwargs: Any) -> Callable[..., QuicProtocol]:
        def create(quic: QuicConnection, stream_handler: Any = None) -> QuicProtocol:
            return QuicProtocol(quic, keepalive=self.idle_timeout / 3, **kwargs)

        return create

    async def listen(self, host: str, port: int, handler: Handler) -> QuicListener:
        configuration = self._configuration(is_client=False)
        configure_quic_server(configuration, self.tls, host)
        listener = QuicListener(handler, self.max_message_bytes, self.close_timeout,
                                listener_binding(self.tls, host))
        create_protocol = self._protocol_factory(owns_transport=False, on_stream=listener.accept)
        admission = Admission(
            max_pending=self.max_pending, max_pending_per_source=self.max_pending_per_source,
            max_connections=self.max_connections, preauth_seconds=self.preauth_seconds,
            name=f"QUIC listener {host}:{port}")
        loop = asyncio.get_running_loop()
        try:
            udp, server = await loop.create_datagram_endpoint(
                lambda: GuardedServer(
                    configuration=configuration, create_protocol=create_protocol,
                    admission=admission, max_handshakes=self.max_handshakes,
                    retry_handshakes=self.retry_handshakes,
                    max_handshakes_per_source=self.max_handshakes_per_source,
                    handshake_timeout=min(self.connect_timeout, HANDSHAKE_SECONDS)),
                local_addr=(host, port),
            )
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise TransportError(f"cannot listen on {host}:{port} (UDP): {reason}") from exc
        _grow_socket_buffers(udp)
        listener.bind(udp, server)
        return listener

    async def connect(self, host: str, port: int) -> QuicStreamConnection:
        where = format_address((host, port))
        configuration = self._configuration(is_client=True)
        configuration.server_name = host
        configure_quic_client(configuration, self.tls)
        loop = asyncio.get_running_loop()
        protocol: QuicProtocol | None = None
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            family, address = infos[0][0], cast(tuple[str, int], infos[0][4])
            quic = GatedConnection(configuration=configuration)
            create_protocol = self._protocol_factory(owns_transport=True)
            udp, protocol = await loop.create_datagram_endpoint(
                lambda: create_protocol(quic), remote_addr=address, family=family)
            _grow_socket_buffers(udp)
            protocol.connect(address)
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.shield(protocol.handshake)
            binding = _peer_binding(quic, where)
        except (OSError, TimeoutError, TransportError) as exc:
            if protocol is not None:
                await protocol.shutdown(0)
            detail = "no answer" if isinstance(exc, TimeoutError) else str(exc)
            raise TransportError(f"cannot connect to {where} over QUIC: {detail}") from exc
        stream_id = quic.get_next_available_stream_id()
        conn = QuicStreamConnection(protocol, stream_id, where, self.max_message_bytes,
                                    self.close_timeout, binding=binding)
        protocol.connection = conn
        quic.send_stream_data(stream_id, PREAMBLE)
        protocol.transmit()
        return conn


def _peer_binding(quic: QuicConnection, where: str) -> bytes:
    """The channel binding of the certificate the listener presented in the handshake."""
    certificate = getattr(quic.tls, "_peer_certificate", None)  # aioquic: no public accessor
    if certificate is None:
        raise TransportError(f"{where} presented no certificate in the QUIC handshake")
    return binding_of_certificate(certificate.public_bytes(Encoding.DER))


def _grow_socket_buffers(udp: asyncio.BaseTransport) -> None:
    """Ask for large UDP buffers (the kernel caps them): bursts of big datagrams fit."""
    sock = udp.get_extra_info("socket")
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
