"""QUIC transport (RFC 9000) on aioquic's asyncio API; always TLS 1.3, ALPN ``burncoll``.

A connection is one QUIC connection carrying one bidirectional stream of length-prefixed
messages (:mod:`burncoll.transport.quic_connection`). Until it is authenticated the other side
gets :data:`~burncoll.transport.base.PREAUTH_BYTES` of flow-control credit and nothing larger
is allocated on its word. A silent peer is declared gone after ``idle_timeout`` (pings every
third of it keep a live one open); a client's UDP socket is connected, so an ICMP "port
unreachable" fails it at once. Throughput: aioquic's defaults give about 30 MB/s; 16 KiB
datagrams (IP fragments them on a LAN; lower ``max_datagram_size`` where fragments are
dropped), ``2 * max_message_bytes`` windows and larger socket buffers lift that several times
over.

Listeners screen handshakes: :class:`GuardedServer` defends a listener against handshake
floods, per source (:func:`source_of`: an IPv4 address, an IPv6 /64) and in all. A new client
must prove its address with a stateless Retry (RFC 9000 section 8.1) when its source already
has a handshake in progress, past ``retry_handshakes``, or at the global cap, so a host cannot
claim slots for addresses it does not hold. At the global cap a validated newcomer evicts the
oldest handshake of the source holding the most, if that source still holds at least as many
as the newcomer's (max-min fairness); otherwise, and over the per-source cap, the Initial is
dropped before any cryptographic work. A handshake not done within ``min(connect_timeout,
HANDSHAKE_SECONDS)`` is dropped. Only completed handshakes reach the listener's
:class:`~burncoll.transport.admission.Admission`, so a flood of Initials cannot evict a client
that is authenticating. A dropped connection is sent CONNECTION_CLOSE and forgotten at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from aioquic._buffer import Buffer as QuicBuffer
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicHeader, QuicPacketType, encode_quic_retry, pull_quic_header
from aioquic.quic.retry import QuicRetryTokenHandler
from cryptography.hazmat.primitives.serialization import Encoding

from burncoll.errors import ConfigError, TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES
from burncoll.transport.admission import Admission, source_group
from burncoll.transport.base import PREAUTH_SECONDS, Handler, TlsSettings, Transport, format_address
from burncoll.transport.listening import ServingListener
from burncoll.transport.quic_connection import (
    ERR_NO_ERROR,
    PREAMBLE,
    PREAUTH_WINDOW,
    GatedConnection,
    QuicProtocol,
    QuicStreamConnection,
)
from burncoll.transport.tls import (
    binding_of_certificate,
    configure_quic_client,
    configure_quic_server,
    listener_binding,
)

__all__ = ["ALPN", "MAX_DATAGRAM_SIZE", "GuardedServer", "QuicListener", "QuicTransport",
           "source_of"]


logger = logging.getLogger("burncoll.transport")

#: Default caps of a listener: handshakes in progress, and above how many a Retry is asked.
MAX_HANDSHAKES = 64
RETRY_HANDSHAKES = 16
#: Default cap on a single source's handshakes in progress (see :func:`source_of`).
MAX_HANDSHAKES_PER_SOURCE = 8
#: The longest a listener waits for a handshake to complete (or ``connect_timeout``, if less).
HANDSHAKE_SECONDS = 3.0


def source_of(address: NetworkAddress | None) -> str:
    """The source a listener counts a peer's handshakes against, grouped as the admission
    groups connections (:func:`~burncoll.transport.admission.source_group`: an IPv4 address,
    also when written IPv4-mapped, or the /64 of an IPv6 one). ``"?"`` when the address is
    unknown or unparsable."""
    if address is None:
        return "?"
    host = str(address[0])
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return "?"
    return source_group(host)


class GuardedServer(QuicServer):
    """aioquic's server, with the new-connection path guarded (see the module docstring):
    caps on handshakes in progress (per source and in all, with eviction of the source holding
    the most), Retry under load and for repeat sources, a handshake deadline, admission."""

    def __init__(self, *, configuration: QuicConfiguration,
                 create_protocol: Callable[..., QuicProtocol], admission: Admission,
                 max_handshakes: int, retry_handshakes: int, handshake_timeout: float,
                 max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE) -> None:
        super().__init__(configuration=configuration, create_protocol=create_protocol)
        self.admission = admission
        self.max_handshakes = max_handshakes
        self.retry_handshakes = retry_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.handshake_timeout = handshake_timeout
        #: Connections whose handshake is in progress, oldest first, with their source.
        self.handshaking: dict[QuicProtocol, str] = {}
        #: Handshakes evicted so far to make room for another source's.
        self.evictions = 0
        self._tokens = QuicRetryTokenHandler()
        self._dropped = 0
        self._logged_at = 0.0

    def in_progress(self, source: str) -> int:
        """How many handshakes ``source`` (as :func:`source_of` names it) has in progress."""
        return sum(1 for s in self.handshaking.values() if s == source)

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        data = cast(bytes, data)
        header = self._new_connection(data)
        if header is None:
            super().datagram_received(data, addr)  # an existing connection, or stateless
        else:
            self._open(header, data, addr)

    def _new_connection(self, data: bytes) -> QuicHeader | None:
        """The header of ``data`` when it is an Initial packet that would open a connection."""
        if len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            return None
        try:
            header = pull_quic_header(QuicBuffer(data=data),
                                      host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return None
        if (header.packet_type != QuicPacketType.INITIAL
                or header.version not in self._configuration.supported_versions
                or header.destination_cid in self._protocols):
            return None
        return header

    def _open(self, header: QuicHeader, data: bytes, addr: NetworkAddress) -> None:
        """Screen an Initial packet for a new connection, then open it (or not). Checks cost nothing
        before the Retry token is read (an AES-GCM open); the only state created for an unvalidated
        address is the connection opened while fewer than ``retry_handshakes`` are in progress and
        none from its source."""
        self._prune()
        source = source_of(addr)
        counts = Counter(self.handshaking.values())
        held = counts[source]
        if held >= self.max_handshakes_per_source:
            self._refused(f"{source} has {held} handshakes in progress")
            return
        admission = self.admission
        if admission.connections + len(self.handshaking) >= admission.max_connections:
            self._refused(f"{admission.max_connections} connections are open or opening")
            return
        full = len(self.handshaking) >= self.max_handshakes
        victim: str | None = None
        if full:
            victim = self._victim(counts, held)
            if victim is None:
                self._refused(f"{self.max_handshakes} handshakes are in progress, "
                              "none from a source holding more than its share")
                return
        retry_cid: bytes | None = None
        if header.token:  # the answer to a Retry: the address is validated
            try:
                original_cid = self._tokens.validate_token(
                    address=addr, destination_cid=header.destination_cid, token=header.token,
                    now=self._loop.time())
            except ValueError:
                return
            retry_cid = header.destination_cid
        elif full or held or len(self.handshaking) >= self.retry_handshakes:
            self._send_retry(header, addr)
            return
        else:
            original_cid = header.destination_cid
        if victim is not None:
            self._evict(victim, source)
        quic = GatedConnection(configuration=self._configuration,
                               original_destination_connection_id=original_cid,
                               retry_source_connection_id=retry_cid)
        protocol = cast(QuicProtocol, self._create_protocol(quic))
        self._register(protocol, header.destination_cid, source)
        protocol.datagram_received(data, addr)

    def _prune(self) -> None:
        """Forget handshakes that ended without the server hearing of it (a safety net: the
        protocol normally reports its end through ``admit`` or ``forget``)."""
        for protocol in [p for p in self.handshaking if p.handshake.done() or p.terminated]:
            del self.handshaking[protocol]

    def _victim(self, counts: Counter[str], held: int) -> str | None:
        """The source whose oldest handshake makes room for a newcomer whose source holds
        ``held``: the one holding the most, if that is more than ``held + 1`` (so never the
        newcomer's own, and never one left with fewer than the newcomer would have)."""
        if not counts:
            return None
        source, most = counts.most_common(1)[0]
        return source if most > held + 1 else None

    def _evict(self, victim: str, newcomer: str) -> None:
        """Drop the oldest handshake in progress from ``victim`` (a CONNECTION_CLOSE is sent)."""
        oldest = next(p for p, s in self.handshaking.items() if s == victim)
        self.evictions += 1
        logger.debug("%s: evicted a handshake from %s (%d in progress) for one from %s",
                     self.admission.name, victim, self.in_progress(victim), newcomer)
        oldest.drop(f"evicted: {self.max_handshakes} handshakes in progress, "
                    f"{victim} holding the most")
        self.handshaking.pop(oldest, None)

    def _register(self, protocol: QuicProtocol, cid: bytes, source: str) -> None:
        """What aioquic's server does for a new connection, plus our bookkeeping."""
        assert self._transport is not None
        protocol.connection_made(self._transport)
        protocol._connection_id_issued_handler = partial(
            self._connection_id_issued, protocol=protocol)
        protocol._connection_id_retired_handler = partial(
            self._connection_id_retired, protocol=protocol)
        protocol._connection_terminated_handler = partial(
            self._connection_terminated, protocol=protocol)
        self._protocols[cid] = protocol
        self._protocols[protocol._quic.host_cid] = protocol
        protocol.admit = self._admit
        protocol.forget = self._forget
        self.handshaking[protocol] = source
        protocol.start_handshake_deadline(self.handshake_timeout)

    def _admit(self, protocol: QuicProtocol) -> bool:
        """A handshake completed: ask the admission (which may evict an older unauthenticated
        connection, and starts the pre-authentication deadline). Refused: dropped."""
        self.handshaking.pop(protocol, None)
        address = protocol._quic.get_peer_address()
        source = str(address[0]).removeprefix("::ffff:") if address is not None else "?"
        ticket = self.admission.admit(source, protocol.drop)
        if ticket is None:
            protocol.drop(f"refused: {self.admission.max_connections} connections are open")
            return False
        protocol.ticket = ticket
        return True

    def _forget(self, protocol: QuicProtocol) -> None:
        """Drop every reference the server holds to ``protocol``."""
        self.handshaking.pop(protocol, None)
        for cid in [cid for cid, p in self._protocols.items() if p is protocol]:
            del self._protocols[cid]

    def _send_retry(self, header: QuicHeader, addr: NetworkAddress) -> None:
        assert self._transport is not None and header.version is not None
        source_cid = os.urandom(8)
        token = self._tokens.create_token(
            address=addr, original_destination_connection_id=header.destination_cid,
            retry_source_connection_id=source_cid, now=self._loop.time())
        self._transport.sendto(
            encode_quic_retry(
                version=header.version, source_cid=source_cid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid, retry_token=token),
            addr,
        )

    def _refused(self, why: str) -> None:
        """Count a dropped Initial packet; log at most one line a second."""
        self._dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            logger.warning("%s: dropped %d Initial packet(s) for new connections: %s",
                           self.admission.name, self._dropped, why)
            self._logged_at, self._dropped = now, 0


class QuicListener(ServingListener):
    """A bound UDP socket accepting QUIC connections; one handler task per connection.

    Args:
        handler: served on each connection, in a task of its own.
        max_message_bytes: the largest message a connection accepts (once authenticated).
        close_timeout: seconds a connection's ``close`` waits for the peer's acknowledgement.
        binding: the channel binding of the listener's certificate.
    """

    def __init__(self, handler: Handler, max_message_bytes: int, close_timeout: float,
                 binding: bytes) -> None:
        super().__init__(handler)
        self.host, self.port = "", 0
        self._max_message_bytes = max_message_bytes
        self._close_timeout = close_timeout
        self._binding = binding
        self._udp: asyncio.DatagramTransport | None = None
        self._server: GuardedServer | None = None

    def bind(self, udp: asyncio.DatagramTransport, server: GuardedServer) -> None:
        self._udp, self._server = udp, server
        sockname = udp.get_extra_info("sockname")
        self.host, self.port = sockname[0], sockname[1]
        server.admission.name = f"QUIC listener {self.host}:{self.port}"

    @property
    def admission(self) -> Admission:
        """The caps on this listener's connections (see :mod:`burncoll.transport.admission`)."""
        assert self._server is not None
        return self._server.admission

    @property
    def tracked(self) -> int:
        """Connection ids the server still routes (aioquic's ``_protocols``): every dropped or
        closed connection's are removed, so this returns to zero when all are gone."""
        return len(self._server._protocols) if self._server is not None else 0

    def accept(self, protocol: QuicProtocol) -> QuicStreamConnection:
        """Called on a new connection's first stream data: start its handler."""
        conn = QuicStreamConnection(protocol, 0, protocol._remote(), self._max_message_bytes,
                                    self._close_timeout, preamble=PREAMBLE, binding=self._binding)
        if self.closing:
            conn._fail(TransportError("the listener is closing"))
            protocol.abort(None, ERR_NO_ERROR, "listener closing")
            return conn
        self.serve(conn)
        return conn

    async def _shut_down(self) -> None:
        assert self._server is not None
        self._server.admission.close()  # drops the unauthenticated connections
        await self._end_handlers()
        self._server.close()  # last: the connections closing above share its socket


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
            (:class:`GuardedServer`).
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
