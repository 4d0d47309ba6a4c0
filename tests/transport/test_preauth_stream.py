"""Before it authenticates, a stranger on a stream transport (tcp, ws, wss) reads at most
``PREAUTH_BYTES`` of this side's attention, whatever it pipelines.

Each attack is a real socket on 127.0.0.1 writing raw bytes, as an attacker's script would:
the frame header goes in the *same* write as the TCP preamble or the WebSocket upgrade, so the
listener parses it before any authentication could have run. The listener's handler plays the
authentication's part only as far as these tests need: it waits for a message and records why
``recv`` failed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import os
import secrets
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import Placed
from burncoll.transport.admission import Admission
from burncoll.transport.base import PREAUTH_BYTES, Connection, TlsSettings, Transport
from burncoll.transport.stream import StreamProtocol
from burncoll.transport.tcp import PREAMBLE, TcpTransport
from burncoll.transport.tls import listener_binding
from burncoll.transport.websocket import WebSocketTransport
from burncoll.transport.ws_frames import frame_header, mask_in_place
from tests import forked
from tests.transport.support import HOST, connected, run, serving, trust

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Attack connections per memory measurement.
ATTACKS = 200
#: What those may cost the process together (each gets at most a PREAUTH_BYTES scratch buffer,
#: 16 KiB, while it lives; the bound leaves room for allocator noise). Before the limit each
#: allocated the announced 64 MiB and received up to a MiB into it.
ATTACK_RSS_BOUND = 24 * 1024 * 1024
#: Bytes of payload an attacker pipelines behind its header.
ATTACK_PAYLOAD = 1024 * 1024


async def _recv_bytes(conn: Connection, timeout: float = 5.0) -> bytes:
    """The next message's bytes (these tests place nothing)."""
    message = await asyncio.wait_for(conn.recv(), timeout)
    assert not isinstance(message, Placed)
    return bytes(message)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _upgrade_request(port: int) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET / HTTP/1.1\r\nHost: {HOST}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode()


def _masked_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    key = secrets.token_bytes(4)
    body = memoryview(bytearray(payload))
    mask_in_place(body, key)
    return frame_header(opcode, len(payload), key, fin=fin) + bytes(body)


def _tcp_attack(port: int) -> bytes:
    """The preamble and a header announcing 64 MiB, then a MiB of it, in one write."""
    return PREAMBLE + (64 << 20).to_bytes(8, "little") + bytes(ATTACK_PAYLOAD)


def _ws_attack(port: int) -> bytes:
    """The upgrade and a masked frame header announcing 64 MiB, then a MiB, in one write."""
    return (_upgrade_request(port) + frame_header(0x2, 64 << 20, secrets.token_bytes(4))
            + bytes(ATTACK_PAYLOAD))


ATTACK_KINDS = {"tcp": _tcp_attack, "websocket": _ws_attack}


def _client_tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _attack_once(port: int, data: bytes, tls: bool) -> None:
    """Connect, hand the kernel what it takes of ``data`` at once, wait for the listener to
    close the connection (a bounded wait), close."""
    raw = socket.create_connection((HOST, port), timeout=5)
    sock: socket.socket = _client_tls().wrap_socket(raw) if tls else raw
    with sock:
        sock.settimeout(0.5)
        with contextlib.suppress(OSError):  # a refusal may reset the connection mid-write
            sock.sendall(data[:PREAUTH_BYTES * 4])  # more than the budget, less than a MiB
            if not tls:  # the rest, as far as the kernel takes it without blocking
                sock.setblocking(False)
                sock.send(data[PREAUTH_BYTES * 4:])
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass  # until the listener closes it


def _attacks(port: int, kind: str, tls: bool, count: int) -> None:
    """Run ``count`` attacks of ``kind``, 20 at a time, each in a thread."""
    make = ATTACK_KINDS[kind]
    for start in range(0, count, 20):
        threads = [threading.Thread(target=_attack_once, args=(port, make(port), tls))
                   for _ in range(min(20, count - start))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


async def _attack_from_child(port: int, kind: str, tls: bool, count: int) -> None:
    """Run the attacks in a child process (forked: tests/forked.py), so that the attacker's
    own buffers do not count in this (the listener's) process's memory."""
    child = forked.start(__file__, str(port), kind, "tls" if tls else "plain", str(count),
                         cwd=ROOT)
    assert await asyncio.to_thread(child.wait) == 0


class Recorder:
    """A handler that receives messages and records why ``recv`` failed, as the exception
    without its traceback (whose frames would keep the connection alive)."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.messages = 0

    async def handler(self, conn: Connection) -> None:
        try:
            while True:
                await conn.recv()
                self.messages += 1
        except (ProtocolError, TransportError) as exc:
            self.errors.append(exc.with_traceback(None))


def _tls_transport(**options: Any) -> Transport:
    return WebSocketTransport(tls=TlsSettings(ephemeral=True), **options)


ATTACKS_BY_TRANSPORT = [
    pytest.param(TcpTransport, "tcp", False, id="tcp"),
    pytest.param(WebSocketTransport, "websocket", False, id="websocket"),
    pytest.param(_tls_transport, "websocket", True, id="websocket-tls"),
]


@pytest.mark.parametrize(("make", "attack", "tls"), ATTACKS_BY_TRANSPORT)
def test_a_header_pipelined_behind_the_handshake_is_refused_without_allocating(
        make: Callable[..., Transport], attack: str, tls: bool) -> None:
    recorder = Recorder()

    async def body() -> tuple[int, int]:
        # The attacker runs 20 connections at once from one address: over wss their TLS
        # handshakes, admitted before they start, would pass the default per-source cap (16)
        # and evict each other. This test is about the byte budget, not admission.
        roomy = lambda: Admission(max_pending_per_source=32)  # noqa: E731
        async with serving(make(admission=roomy), recorder.handler) as served:
            await _attack_from_child(served.port, attack, tls, 20)  # warm up allocators
            before = _rss()
            await _attack_from_child(served.port, attack, tls, ATTACKS)
            return before, _rss()

    before, after = run(body(), timeout=120)
    assert after - before < ATTACK_RSS_BOUND, (
        f"{ATTACKS} attacks grew the process by {(after - before) >> 20} MiB")
    assert recorder.messages == 0
    assert len(recorder.errors) == ATTACKS + 20
    for error in recorder.errors:
        assert isinstance(error, ProtocolError), error
        assert "pre-authentication limit" in str(error) and str(PREAUTH_BYTES) in str(error)


@pytest.mark.parametrize("make", [TcpTransport, WebSocketTransport], ids=["tcp", "websocket"])
def test_small_messages_count_against_one_budget_until_authenticated(
        make: Callable[..., Transport]) -> None:
    """Messages each under the limit are refused once together they pass it; after
    ``authenticated`` far more flows."""
    async def body() -> None:
        recorder = Recorder()
        async with serving(make(), recorder.handler) as served:
            stranger = await make().connect(HOST, served.port)
            trust(stranger)  # only its receiving side: the listener's stays limited
            try:
                for _ in range(PREAUTH_BYTES // 1000 + 2):
                    await stranger.send([bytes(1000)])
                with pytest.raises(TransportError):
                    async with asyncio.timeout(5):
                        await stranger.recv()
            finally:
                await stranger.close()
        assert 10 <= recorder.messages <= PREAUTH_BYTES // 1000
        assert len(recorder.errors) == 1
        assert "pre-authentication limit" in str(recorder.errors[0])

    run(body())


@pytest.mark.parametrize("make", [TcpTransport, WebSocketTransport, _tls_transport],
                         ids=["tcp", "websocket", "websocket-tls"])
def test_after_authentication_large_messages_and_pipelined_ones_flow(
        make: Callable[..., Transport]) -> None:
    """The listener sends a large message right behind its last pre-authentication one: the
    client, which authenticates only after taking that one, reads the large one whole."""
    async def body() -> None:
        async with serving(make()) as served:
            client = await make().connect(HOST, served.port)
            try:
                server = await asyncio.wait_for(served.accepted.get(), 5)
                big = os.urandom(8 << 20)
                server.authenticated()
                await server.send([b"welcome"])
                # pipelined behind the welcome (sent meanwhile: the client reads it only once
                # it has authenticated)
                sending = asyncio.create_task(server.send([big]))
                assert await _recv_bytes(client, 5) == b"welcome"
                client.authenticated()
                assert await _recv_bytes(client, 10) == big
                await sending
                await client.send([big])
                assert await _recv_bytes(server, 10) == big
            finally:
                await client.close()

    run(body())


def test_a_fragment_flood_before_authentication_is_refused() -> None:
    recorder = Recorder()

    async def body() -> None:
        async with serving(WebSocketTransport(), recorder.handler) as served:
            for fragments in (5, 4095):
                reader, writer = await asyncio.open_connection(HOST, served.port)
                flood = [_masked_frame(0x2, b"", fin=False)]
                flood += [_masked_frame(0x0, b"", fin=False) for _ in range(fragments - 1)]
                writer.write(_upgrade_request(served.port) + b"".join(flood))
                await writer.drain()
                with contextlib.suppress(ConnectionError):  # dropped at once: maybe a reset
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    assert head.startswith(b"HTTP/1.1 101")
                    await asyncio.wait_for(reader.read(), 5)  # until closed
                writer.close()

    run(body())
    assert recorder.messages == 0 and len(recorder.errors) == 2
    for error in recorder.errors:
        assert "more than 4 fragments before authenticating" in str(error), error


def test_an_http_handshake_over_the_budget_is_refused() -> None:
    recorder = Recorder()

    async def body() -> None:
        async with serving(WebSocketTransport(), recorder.handler) as served:
            reader, writer = await asyncio.open_connection(HOST, served.port)
            padding = b"X-Padding: " + b"a" * (PREAUTH_BYTES + 100) + b"\r\n"
            request = _upgrade_request(served.port)
            writer.write(request[:-2] + padding + b"\r\n")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(), 5)  # closed, maybe after a 400
                assert not answer.startswith(b"HTTP/1.1 101")
            writer.close()

    run(body())
    assert recorder.errors == [] and recorder.messages == 0  # never opened


def _live_protocols() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, StreamProtocol))


@pytest.mark.parametrize(("make", "attack", "tls"), ATTACKS_BY_TRANSPORT)
def test_a_dropped_strangers_buffers_are_freed_without_a_garbage_collection(
        make: Callable[..., Transport], attack: str, tls: bool) -> None:
    """No reference cycle holds a dropped connection's protocol (and its scratch buffer)."""
    recorder = Recorder()

    async def body() -> tuple[int, int, int]:
        async with serving(make(), recorder.handler) as served:
            await _attack_from_child(served.port, attack, tls, 1)  # warm-up: imports, caches
            await asyncio.sleep(0.1)
            baseline = _live_protocols()
            await _attack_from_child(served.port, attack, tls, 5)
            for _ in range(50):  # the handlers finish and the transports let go
                await asyncio.sleep(0.02)
                if _live_protocols() == baseline:
                    break
            after_attacks = _live_protocols()
            # and a connection that authenticated, then closed normally
            client = await make().connect(HOST, served.port)
            trust(client)
            await client.send([b"x" * 100])
            await client.close()
            del client
            for _ in range(50):
                await asyncio.sleep(0.02)
                if _live_protocols() == baseline:
                    break
            return baseline, after_attacks, _live_protocols()

    gc.collect()
    gc.disable()
    try:
        baseline, after_attacks, after_close = run(body())
    finally:
        gc.enable()
    assert after_attacks == baseline, "a dropped stranger's protocol is still alive"
    assert after_close == baseline, "a closed connection's protocol is still alive"


def test_channel_binding_is_the_listeners_certificate_on_both_ends_over_wss() -> None:
    settings = TlsSettings(ephemeral=True)

    async def body() -> None:
        async with connected(WebSocketTransport(tls=settings)) as (client, server, _):
            assert client.channel_binding() == server.channel_binding()
            assert server.channel_binding() == listener_binding(settings, HOST)
            assert len(server.channel_binding()) == 32
        for plain in (WebSocketTransport(), TcpTransport()):
            async with connected(plain) as (client, server, _):
                assert client.channel_binding() == server.channel_binding() == b""

    run(body())


if __name__ == "__main__":  # the attacker's side: PORT KIND tls|plain COUNT
    _attacks(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "tls", int(sys.argv[4]))
