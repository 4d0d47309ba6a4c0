"""Attacks on a live collective's listeners, as a stranger on the same network makes them.

Every attack here connects to ``127.0.0.1`` from :data:`ATTACKER_HOST` (another loopback
address: to the victim it is another machine, so caps per source address apply to it and not
to the legitimate nodes) and returns an :class:`AttackReport` -- what it managed to send and
whether the listener dropped it. Attacks stop early when ``stop`` is set (the victim's memory
passed a safety ceiling: a failing test must not take the machine's memory with it) and hold
their connections open ``hold`` seconds, so that whatever they cost is held at once.

Pre-authentication (issue 11, "What to build" 1 and 2):

* :func:`stream_pipelined` -- the TCP preamble, or a WebSocket upgrade, and in the *same
  packet* a frame header announcing 64 MiB; then the payload, as fast as the listener reads.
* :func:`ws_fragments` -- an upgrade, then thousands of empty fragments of one message.
* :func:`idle_flood` -- connections that say nothing.
* :func:`quic_length_prefix` -- a QUIC handshake, then the stream preamble and a length prefix
  announcing 64 MiB (12 bytes), then data.
* :func:`quic_stream_offset` -- a QUIC handshake, then one STREAM frame at the largest offset
  the listener's flow-control window allows (aioquic zero-fills up to it).
* :func:`quic_initial_flood` -- Initial packets, each of a new connection, as fast as asked.

Man in the middle (issue 11, "What to build" 4): :class:`Relay` holds no token; it accepts a
node's connection (TLS terminated with its own ephemeral certificate where the transport has
TLS), connects to the real node the same way, forwards the authentication exchange both ways,
then flips one byte in the middle of every large message (array data) it forwards.

No token (issue 11, "What to build" 5): :func:`register_first` (a stranger's join with another
``num_nodes``) and :func:`hello_as_node` (a stranger saying ``hello`` on a data port).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from burncoll.errors import CollectiveError
from burncoll.protocol.wire import FrameType, decode, encode_control
from burncoll.transport import TlsSettings, get_transport
from burncoll.transport.base import Buffer, Connection
from burncoll.transport.quic import ALPN
from burncoll.transport.quic_connection import PREAMBLE as QUIC_PREAMBLE
from burncoll.transport.tcp import PREAMBLE as TCP_PREAMBLE

#: The victims' address.
HOST = "127.0.0.1"
#: The attacker's source address: another loopback address, as if another machine.
ATTACKER_HOST = "127.0.0.2"
#: What the pipelined frame headers announce.
ANNOUNCED = 64 * 1024 * 1024
#: Payload bytes written per ``write`` after a pipelined header.
CHUNK = 64 * 1024
#: How long an attack waits for a connection or a handshake.
CONNECT_WITHIN = 5.0

T = TypeVar("T")


@dataclass
class AttackReport:
    """What one attack did. ``dropped``: connections the listener closed before the attacker
    did; ``refused``: connections (or handshakes) that never opened."""

    name: str
    target: str
    attempted: int = 0
    opened: int = 0
    dropped: int = 0
    refused: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    stopped_by_alarm: bool = False
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        alarm = ", STOPPED: the victim's memory passed the safety ceiling" if (
            self.stopped_by_alarm) else ""
        notes = f"; {'; '.join(self.notes[:3])}" if self.notes else ""
        return (f"{self.name} -> {self.target}: {self.attempted} tried, {self.opened} opened, "
                f"{self.refused} refused, {self.dropped} dropped by the listener, "
                f"{self.bytes_sent / 2**20:.1f} MiB sent in {self.seconds:.1f} s{alarm}{notes}")


# -- stream transports (tcp, websocket) --------------------------------------------------------


def _upgrade_request(port: int) -> bytes:
    """A WebSocket client's opening handshake (an HTTP Upgrade), as the ``websockets``
    library writes it."""
    client = ClientProtocol(parse_uri(f"ws://{HOST}:{port}/"))
    client.send_request(client.connect())
    return b"".join(client.data_to_send())


def _ws_header(opcode: int, size: int, fin: bool = True) -> bytes:
    """A masked (client) frame header with the all-zero masking key: the payload that follows
    is sent as is."""
    first = (0x80 if fin else 0) | opcode
    if size < 126:
        head = bytes((first, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((first, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, 0x80 | 127)) + size.to_bytes(8, "big")
    return head + b"\0\0\0\0"


def pipelined_opening(transport: str, port: int, announced: int = ANNOUNCED) -> bytes:
    """The first packet of a pipelining stranger: the transport's opening and, behind it, a
    frame header announcing ``announced`` bytes."""
    if transport == "tcp":
        return TCP_PREAMBLE + announced.to_bytes(8, "little")
    return _upgrade_request(port) + _ws_header(0x2, announced)


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(CONNECT_WITHIN):
        return await asyncio.open_connection(HOST, port, local_addr=(ATTACKER_HOST, 0))


def _closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    return reader.at_eof() or writer.is_closing()


async def _drain_reads(reader: asyncio.StreamReader) -> None:
    """Read (and discard) what the listener says, so its close is seen."""
    with contextlib.suppress(OSError):
        while await reader.read(65536):
            pass


async def _hold_streams(report: AttackReport, streams: list[tuple[asyncio.StreamReader,
                                                                   asyncio.StreamWriter]],
                        until: float) -> None:
    """Keep ``streams`` open until ``until``; then count those the listener closed, close all."""
    while time.monotonic() < until:
        await asyncio.sleep(0.05)
    for reader, writer in streams:
        if _closed(reader, writer):
            report.dropped += 1
        writer.close()
    for _, writer in streams:
        with contextlib.suppress(OSError, ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


async def _many(count: int, one: Callable[[int], Awaitable[None]], parallel: int = 50) -> None:
    """Run ``one(i)`` for ``i < count``, at most ``parallel`` at a time."""
    gate = asyncio.Semaphore(parallel)

    async def gated(i: int) -> None:
        async with gate:
            await one(i)

    await asyncio.gather(*(gated(i) for i in range(count)))


async def stream_pipelined(transport: str, port: int, target: str, connections: int,
                           stop: threading.Event, *, send_cap: int = 8 << 20,
                           hold: float = 2.0) -> AttackReport:
    """``connections`` strangers, each opening with :func:`pipelined_opening` in one packet and
    then sending up to ``send_cap`` payload bytes (zeros) as fast as the listener takes them."""
    report = AttackReport(f"pipelined {ANNOUNCED >> 20} MiB header", target)
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    started = time.monotonic()
    chunk = bytes(CHUNK)

    async def one(i: int) -> None:
        report.attempted += 1
        try:
            reader, writer = await _open(port)
        except (OSError, TimeoutError):
            report.refused += 1
            return
        report.opened += 1
        streams.append((reader, writer))
        asyncio.get_running_loop().create_task(_drain_reads(reader))
        try:
            writer.write(pipelined_opening(transport, port))
            sent = 0
            while sent < send_cap and not stop.is_set() and not _closed(reader, writer):
                writer.write(chunk)
                async with asyncio.timeout(hold):
                    await writer.drain()
                sent += len(chunk)
                report.bytes_sent += len(chunk)
        except (OSError, ConnectionError, TimeoutError):
            pass  # the listener stopped reading or closed: what the attack wants to learn

    await _many(connections, one)
    report.stopped_by_alarm = stop.is_set()
    await _hold_streams(report, streams, time.monotonic() + hold)
    report.seconds = time.monotonic() - started
    return report


async def ws_fragments(port: int, target: str, connections: int, stop: threading.Event, *,
                       fragments: int = 4095, hold: float = 2.0) -> AttackReport:
    """``connections`` strangers, each sending a WebSocket upgrade and, behind it, one message
    in ``fragments`` empty fragments that never ends (6 bytes each: ~24 KB per connection)."""
    report = AttackReport(f"ws {fragments} empty fragments", target)
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    started = time.monotonic()
    body = _ws_header(0x2, 0, fin=False) + _ws_header(0x0, 0, fin=False) * (fragments - 1)

    async def one(i: int) -> None:
        report.attempted += 1
        if stop.is_set():
            return
        try:
            reader, writer = await _open(port)
        except (OSError, TimeoutError):
            report.refused += 1
            return
        report.opened += 1
        streams.append((reader, writer))
        asyncio.get_running_loop().create_task(_drain_reads(reader))
        with contextlib.suppress(OSError, ConnectionError):
            writer.write(_upgrade_request(port) + body)
            report.bytes_sent += len(body)

    await _many(connections, one)
    report.stopped_by_alarm = stop.is_set()
    await _hold_streams(report, streams, time.monotonic() + hold)
    report.seconds = time.monotonic() - started
    return report


async def idle_flood(port: int, target: str, connections: int, stop: threading.Event, *,
                     during: Callable[[], Awaitable[None]] | None = None,
                     hold: float = 2.0) -> AttackReport:
    """Open ``connections`` TCP connections that say nothing, keep them open while ``during()``
    runs (a legitimate node registering, say) and ``hold`` seconds more, then close them."""
    report = AttackReport("idle connections", target)
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    started = time.monotonic()

    async def one(i: int) -> None:
        report.attempted += 1
        if stop.is_set():
            return
        try:
            reader, writer = await _open(port)
        except (OSError, TimeoutError) as exc:
            report.refused += 1
            if len(report.notes) < 1:
                report.notes.append(f"connect failed: {exc!r}")
            return
        report.opened += 1
        streams.append((reader, writer))
        asyncio.get_running_loop().create_task(_drain_reads(reader))

    await _many(connections, one, parallel=100)
    report.stopped_by_alarm = stop.is_set()
    if during is not None:
        await during()
    await _hold_streams(report, streams, time.monotonic() + hold)
    report.seconds = time.monotonic() - started
    return report


# -- QUIC ----------------------------------------------------------------------------------------


def _quic_configuration() -> QuicConfiguration:
    return QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE,
                             server_name=HOST)


async def quic_client(port: int) -> QuicConnectionProtocol:
    """A bare aioquic client from :data:`ATTACKER_HOST`, handshake done (not burncoll's)."""
    quic = QuicConnection(configuration=_quic_configuration())
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(
        lambda: QuicConnectionProtocol(quic), local_addr=(ATTACKER_HOST, 0))
    protocol.connect((HOST, port))
    try:
        async with asyncio.timeout(CONNECT_WITHIN):
            await protocol.wait_connected()
    except BaseException:
        protocol.close()
        raise
    return protocol


async def _quic_attack(name: str, port: int, target: str, connections: int,
                       stop: threading.Event, send: Callable[[QuicConnection, AttackReport], None],
                       hold: float) -> AttackReport:
    report = AttackReport(name, target)
    protocols: list[QuicConnectionProtocol] = []
    started = time.monotonic()

    async def one(i: int) -> None:
        report.attempted += 1
        if stop.is_set():
            return
        try:
            protocol = await quic_client(port)
        except (ConnectionError, TimeoutError, OSError) as exc:
            report.refused += 1
            if not report.notes:
                report.notes.append(f"handshake failed: {exc!r}")
            return
        report.opened += 1
        protocols.append(protocol)
        send(protocol._quic, report)
        protocol.transmit()

    await _many(connections, one, parallel=10)
    report.stopped_by_alarm = stop.is_set()
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        for protocol in protocols:
            protocol.transmit()  # whatever flow control now lets through
    for protocol in protocols:
        if protocol._quic._close_event is not None or protocol._closed.is_set():
            report.dropped += 1
        protocol.close()
    for protocol in protocols:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(protocol.wait_closed(), 1.0)
    report.seconds = time.monotonic() - started
    return report


async def quic_length_prefix(port: int, target: str, connections: int, stop: threading.Event,
                             *, extra: int = 256 * 1024, hold: float = 2.0) -> AttackReport:
    """``connections`` QUIC strangers, each opening its stream with the preamble and a length
    prefix announcing 64 MiB (12 bytes), then ``extra`` bytes of that message."""

    def send(quic: QuicConnection, report: AttackReport) -> None:
        stream = quic.get_next_available_stream_id()
        data = QUIC_PREAMBLE + ANNOUNCED.to_bytes(8, "little") + bytes(extra)
        quic.send_stream_data(stream, data)
        report.bytes_sent += len(data)

    return await _quic_attack(f"quic 12-byte prefix announcing {ANNOUNCED >> 20} MiB", port,
                              target, connections, stop, send, hold)


async def quic_stream_offset(port: int, target: str, connections: int, stop: threading.Event,
                             *, hold: float = 2.0) -> AttackReport:
    """``connections`` QUIC strangers, each sending one STREAM frame of 1 KiB that ends at
    the edge of the flow-control window the listener granted (stream and connection)."""

    def send(quic: QuicConnection, report: AttackReport) -> None:
        stream_id = quic.get_next_available_stream_id()
        stream = quic._get_or_create_stream_for_send(stream_id)
        window = min(quic._remote_max_data, stream.max_stream_data_remote)
        offset = max(window - 1024, 0)
        sender = stream.sender
        sender._buffer_start = sender._buffer_stop = offset  # skip ahead: a gap before it
        quic.send_stream_data(stream_id, b"x" * min(1024, window))
        report.bytes_sent += min(1024, window)
        if len(report.notes) < 1:
            report.notes.append(f"window granted before authentication: {window} bytes")

    return await _quic_attack("quic STREAM frame at the window's edge", port, target,
                              connections, stop, send, hold)


def initial_packets(port: int, count: int) -> list[bytes]:
    """``count`` QUIC Initial datagrams, each opening another connection (its own keys)."""
    packets = []
    for _ in range(count):
        quic = QuicConnection(configuration=_quic_configuration())
        now = time.monotonic()
        quic.connect((HOST, port), now=now)
        datagrams = quic.datagrams_to_send(now=now)
        packets.append(datagrams[0][0])
    return packets


async def quic_initial_flood(port: int, target: str, packets: list[bytes], seconds: float,
                             stop: threading.Event, *, hold: float = 2.0) -> AttackReport:
    """Send ``packets`` (see :func:`initial_packets`) evenly over ``seconds``, from one UDP
    socket that never answers; then wait ``hold`` seconds."""
    report = AttackReport(f"quic {len(packets)} Initial packets in {seconds:g} s", target)
    started = time.monotonic()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((ATTACKER_HOST, 0))
        sock.setblocking(False)
        batch = max(len(packets) // max(int(seconds / 0.01), 1), 1)
        for i in range(0, len(packets), batch):
            if stop.is_set():
                report.stopped_by_alarm = True
                break
            for packet in packets[i:i + batch]:
                report.attempted += 1
                with contextlib.suppress(BlockingIOError):
                    sock.sendto(packet, (HOST, port))
                    report.bytes_sent += len(packet)
            due = started + seconds * (i + batch) / len(packets)
            await asyncio.sleep(max(due - time.monotonic(), 0))
    await asyncio.sleep(hold)
    report.seconds = time.monotonic() - started
    return report


# -- the man in the middle ---------------------------------------------------------------------


class Relay:
    """A man in the middle holding **no token**, in front of one node's data port.

    It listens with the victims' transport (its own ephemeral certificate where that
    transport runs TLS), and for every connection it accepts it connects to
    ``127.0.0.1:target_port`` the same way and forwards every message both ways. Once
    ``flip_after`` messages have passed a connection, it flips one byte in the middle of every
    message of at least :attr:`LARGE` bytes (array data) on its way to the dialer.
    """

    LARGE = 16 * 1024

    def __init__(self, transport: str, tls: bool, target_port: int, flip_after: int = 3) -> None:
        self.transport_name = transport
        self.tls = tls
        self.target_port = target_port
        self.flip_after = flip_after
        self.forwarded = 0
        self.flipped = 0
        self.errors: list[str] = []
        self.port = 0
        self._listener: Any = None

    def _transport(self) -> Any:
        tls = TlsSettings(ephemeral=True) if self.tls else None
        return get_transport(self.transport_name, tls=tls)

    async def start(self) -> int:
        self._listener = await self._transport().listen(HOST, 0, self._serve)
        self.port = int(self._listener.port)
        return self.port

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()

    async def _serve(self, dialer: Connection) -> None:
        try:
            node = await self._transport().connect(HOST, self.target_port)
        except CollectiveError as exc:
            self.errors.append(f"could not reach the node: {exc}")
            return
        for conn in (dialer, node):  # the relay's own pre-authentication limits: lifted
            with contextlib.suppress(Exception):
                conn.authenticated()
        try:
            await asyncio.gather(self._pump(dialer, node, flip=False),
                                 self._pump(node, dialer, flip=True))
        except CollectiveError as exc:
            self.errors.append(str(exc)[:300])
        finally:
            await asyncio.gather(dialer.close(), node.close(), return_exceptions=True)

    async def _pump(self, source: Connection, sink: Connection, flip: bool) -> None:
        passed = 0
        try:
            while True:
                message = bytearray(_as_bytes(await source.recv()))
                passed += 1
                if flip and passed > self.flip_after and len(message) >= self.LARGE:
                    message[len(message) // 2] ^= 0x01
                    self.flipped += 1
                await sink.send([message])
                self.forwarded += 1
        finally:
            await asyncio.gather(source.close(), sink.close(), return_exceptions=True)


def _as_bytes(message: Any) -> Buffer:
    if isinstance(message, bytes | bytearray | memoryview):
        return message
    raise TypeError(f"the relay got a {type(message).__name__}, not bytes")


# -- no token: strangers that speak burncoll -----------------------------------------------------


async def _authenticated(transport: str, port: int, token: str | None) -> Connection:
    from burncoll.transport.auth import authenticate_client

    conn = await get_transport(transport).connect(HOST, port)
    result = await authenticate_client(conn, token, CONNECT_WITHIN)
    return result if isinstance(result, Connection) else conn


async def register_first(transport: str, port: int, num_nodes: int, peer_ids: list[int],
                         fingerprint: dict[str, Any]) -> Connection:
    """A stranger (no token, like everyone) joins the orchestrator first, claiming a
    collective of ``num_nodes``; the connection stays open (it waits among the pending)."""
    conn = await _authenticated(transport, port, None)
    await conn.send([encode_control({
        "type": "join", "host": ATTACKER_HOST, "port": 9, "peer_ids": peer_ids,
        "fingerprint": {**fingerprint, "num_nodes": num_nodes}, "pid": 1, "meta": {}})])
    return conn


@dataclass
class HelloOutcome:
    """What a stranger saying ``hello`` on a data port received."""

    connected: bool = False
    data_frames: int = 0
    data_bytes: int = 0
    control: list[str] = field(default_factory=list)
    error: str = ""


async def hello_as_node(transport: str, port: int, node: int, session: int | None,
                        listen_for: float, token: str | None = None) -> HelloOutcome:
    """Connect to a data port (retrying until it listens, for up to ``listen_for`` seconds),
    pass authentication as anyone can without a token, say ``hello`` as ``node`` (with
    ``session`` when given), and count the array data received until ``listen_for`` ends."""
    outcome = HelloOutcome()
    deadline = time.monotonic() + listen_for
    conn: Connection | None = None
    while conn is None and time.monotonic() < deadline:
        try:
            conn = await _authenticated(transport, port, token)
        except CollectiveError as exc:
            outcome.error = str(exc)[:300]
            await asyncio.sleep(0.01)
    if conn is None:
        return outcome
    outcome.connected = True
    hello: dict[str, Any] = {"type": "hello", "node": node}
    if session is not None:
        hello["session"] = session
    try:
        await conn.send([encode_control(hello, session or 0)])
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
            while True:
                frame = decode(await conn.recv())
                if frame.frame_type == FrameType.DATA:
                    outcome.data_frames += 1
                    outcome.data_bytes += len(frame.payload)
                elif frame.control is not None:
                    outcome.control.append(str(frame.control.get("type")))
    except TimeoutError:
        pass
    except CollectiveError as exc:
        outcome.error = str(exc)[:300]
    finally:
        await conn.close()
    return outcome


# -- running coroutines from a synchronous test --------------------------------------------------


class BackgroundLoop:
    """An asyncio event loop in a thread, for attacks and relays that must run while the
    test thread waits on child processes; a context manager."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        """Schedule ``coro``; a :class:`concurrent.futures.Future` of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        result: T = self.submit(coro).result(timeout)
        return result

    def close(self) -> None:
        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.submit(cancel_rest()).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raise_nofile(wanted: int = 8192) -> None:
    """Let the attacker (this process) hold many connections: raise its soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


__all__ = [
    "ANNOUNCED",
    "ATTACKER_HOST",
    "HOST",
    "AttackReport",
    "BackgroundLoop",
    "HelloOutcome",
    "Relay",
    "hello_as_node",
    "idle_flood",
    "initial_packets",
    "pipelined_opening",
    "quic_client",
    "quic_initial_flood",
    "quic_length_prefix",
    "quic_stream_offset",
    "raise_nofile",
    "register_first",
    "stream_pipelined",
    "ws_fragments",
]
