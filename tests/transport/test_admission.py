"""Listener admission: pending caps with oldest-first eviction, a total cap, a deadline.

The first tests drive :class:`Admission` directly (its callers are the listeners); the rest
attack a real TCP or WebSocket listener on 127.0.0.1 with raw sockets. Strangers come from
several loopback addresses (127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to ``lo``)
so that the per-source and the overall caps can be told apart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

import pytest

from burncoll.errors import TransportError
from burncoll.protocol.wire import Placed
from burncoll.transport.admission import LOG_BURST, Admission, source_group
from burncoll.transport.auth import authenticate_client, authenticate_server
from burncoll.transport.base import Connection, TlsSettings, Transport
from burncoll.transport.listening import StreamListener
from burncoll.transport.tcp import TcpTransport
from burncoll.transport.websocket import WebSocketTransport
from tests.transport.support import HOST, run, serving

STREAM_TRANSPORTS = [pytest.param(TcpTransport, id="tcp"),
                     pytest.param(WebSocketTransport, id="websocket")]


async def _recv_bytes(conn: Connection, timeout: float = 5.0) -> bytes:
    """The next message's bytes (these tests place nothing)."""
    message = await asyncio.wait_for(conn.recv(), timeout)
    assert not isinstance(message, Placed)
    return bytes(message)


class Dropped:
    """Records ``drop(reason)`` calls by connection name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def drop_for(self, name: str) -> Callable[[str], None]:
        return lambda reason: self.calls.append((name, reason))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def test_the_oldest_pending_connection_of_the_source_is_evicted_first() -> None:
    async def body() -> None:
        admission = Admission(max_pending=10, max_pending_per_source=3, max_connections=100)
        dropped = Dropped()
        tickets = {}
        for name, source in [("a1", "A"), ("b1", "B"), ("a2", "A"), ("a3", "A")]:
            tickets[name] = admission.admit(source, dropped.drop_for(name))
        assert dropped.names == []
        tickets["a4"] = admission.admit("A", dropped.drop_for("a4"))  # A is full: a1 goes
        assert dropped.names == ["a1"]
        assert "max_pending_per_source" in dropped.calls[0][1]
        assert tickets["a1"] is not None and tickets["a1"].released
        tickets["a2"].authenticated()  # type: ignore[union-attr]
        tickets["a5"] = admission.admit("A", dropped.drop_for("a5"))  # room again: nobody goes
        assert dropped.names == ["a1"]
        assert admission.pending == 4 and admission.connections == 5  # b1 a3 a4 a5; + a2
        admission.close()

    run(body())


def test_the_oldest_pending_connection_overall_is_evicted_when_all_are_full() -> None:
    async def body() -> None:
        admission = Admission(max_pending=4, max_pending_per_source=4, max_connections=100)
        dropped = Dropped()
        for i in range(4):
            admission.admit(f"S{i}", dropped.drop_for(f"c{i}"))
        admission.admit("S9", dropped.drop_for("new1"))
        admission.admit("S9", dropped.drop_for("new2"))
        assert dropped.names == ["c0", "c1"]
        assert all("max_pending" in reason for _, reason in dropped.calls)
        assert admission.pending == 4
        admission.close()
        assert dropped.names == ["c0", "c1", "c2", "c3", "new1", "new2"]
        assert admission.admit("S0", dropped.drop_for("late")) is None  # closed

    run(body())


def test_at_the_overall_cap_the_source_holding_the_most_loses_its_oldest() -> None:
    """A legitimate node's one pending connection, the oldest of all, survives a churn of
    strangers from several addresses: each newcomer evicts from the most crowded source."""
    async def body() -> None:
        admission = Admission(max_pending=6, max_pending_per_source=6, max_connections=100)
        dropped = Dropped()
        node = admission.admit("10.0.0.1", dropped.drop_for("node"))
        assert node is not None
        for i in range(5):
            admission.admit("10.0.0.2" if i < 3 else "10.0.0.3", dropped.drop_for(f"x{i}"))
        assert dropped.names == []  # node x0 x1 x2 (.2) x3 x4 (.3): full
        admission.admit("10.0.0.4", dropped.drop_for("y0"))  # .2 holds 3: its oldest goes
        assert dropped.names == ["x0"]
        assert "max_pending" in dropped.calls[0][1] and "from this source" in dropped.calls[0][1]
        admission.admit("10.0.0.4", dropped.drop_for("y1"))  # .2 and .3 hold 2: .2's is older
        admission.admit("10.0.0.5", dropped.drop_for("y2"))  # .3 (x3 x4), .4 (y0 y1): x3 older
        assert dropped.names == ["x0", "x1", "x3"]
        # churn from 3 addresses: 5 strangers' slots over at most 4 sources, one holds 2
        for i in range(200):
            admission.admit(f"10.0.0.{(2, 4, 5)[i % 3]}", dropped.drop_for(f"z{i}"))
        assert "node" not in dropped.names and not node.released
        assert admission.pending == 6 and len(dropped.names) == 203
        # only when every source holds one (it takes max_pending addresses) does the oldest
        # overall, the node, go
        for i in range(6):
            admission.admit(f"10.0.2.{i}", dropped.drop_for(f"u{i}"))
        assert node.released and "node" in dropped.names
        admission.close()

    run(body())


def test_equal_counts_evict_the_oldest_overall() -> None:
    async def body() -> None:
        admission = Admission(max_pending=3, max_pending_per_source=3, max_connections=100)
        dropped = Dropped()
        for name in ("a", "b", "c"):
            admission.admit(f"10.0.0.{ord(name)}", dropped.drop_for(name))
        admission.admit("10.0.0.200", dropped.drop_for("d"))
        admission.admit("10.0.0.201", dropped.drop_for("e"))
        assert dropped.names == ["a", "b"]
        admission.close()

    run(body())


def test_ipv6_sources_are_grouped_by_their_64() -> None:
    assert source_group("2001:db8:1:2::5") == source_group("2001:db8:1:2:ffff::9")
    assert source_group("2001:db8:1:2::5") == "2001:db8:1:2::/64"
    assert source_group("2001:db8:1:3::5") != source_group("2001:db8:1:2::5")
    assert source_group("fe80::1%eth0") == "fe80::/64"
    assert source_group("10.0.0.1") != source_group("10.0.0.2")
    assert source_group("::ffff:10.0.0.1") == "10.0.0.1"
    assert source_group("?") == "?"

    async def body() -> None:
        admission = Admission(max_pending=10, max_pending_per_source=2, max_connections=100)
        dropped = Dropped()
        # one host rotating through addresses of its /64 is one source to the per-source cap
        for i in range(4):
            admission.admit(f"2001:db8:0:7::{i + 1:x}", dropped.drop_for(f"v{i}"))
        assert dropped.names == ["v0", "v1"]
        assert "2001:db8:0:7::/64" in dropped.calls[0][1]
        admission.close()
        # and to the overall cap: at it, the /64 holding the most loses its oldest (counted
        # address by address, all would hold one, and the oldest overall, the node, would go)
        admission, dropped = Admission(max_pending=4, max_pending_per_source=4,
                                       max_connections=100), Dropped()
        admission.admit("2001:db8:0:1::1", dropped.drop_for("node"))
        for i in range(3):
            admission.admit(f"2001:db8:0:8::{i + 1:x}", dropped.drop_for(f"w{i}"))
        admission.admit("2001:db8:0:9::1", dropped.drop_for("late"))
        assert dropped.names == ["w0"]
        admission.close()

    run(body())


def test_max_connections_refuses_and_release_is_idempotent() -> None:
    async def body() -> None:
        admission = Admission(max_pending=8, max_pending_per_source=8, max_connections=2)
        dropped = Dropped()
        first = admission.admit("A", dropped.drop_for("first"))
        second = admission.admit("A", dropped.drop_for("second"))
        assert first is not None and second is not None
        first.authenticated()
        assert admission.admit("A", dropped.drop_for("third")) is None  # refused, nobody evicted
        assert dropped.names == []
        first.release()
        first.release()
        assert admission.connections == 1
        assert admission.admit("A", dropped.drop_for("fourth")) is not None
        admission.close()

    run(body())


def test_a_connection_still_pending_at_the_deadline_is_dropped_once() -> None:
    async def body() -> None:
        admission = Admission(preauth_seconds=0.1)
        dropped = Dropped()
        slow = admission.admit("A", dropped.drop_for("slow"))
        quick = admission.admit("A", dropped.drop_for("quick"))
        assert slow is not None and quick is not None
        quick.authenticated()
        await asyncio.sleep(0.3)
        assert dropped.names == ["slow"] and "not authenticated within 0.1 s" in dropped.calls[0][1]
        assert slow.released and not quick.released and admission.connections == 1

    run(body())


def test_evictions_are_logged_at_most_ten_a_second_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        admission = Admission(max_pending=1, max_pending_per_source=1, max_connections=10_000)
        for _ in range(500):
            admission.admit("A", lambda reason: None)
        await asyncio.sleep(1.05)
        admission.admit("A", lambda reason: None)
        admission.close()

    with caplog.at_level(logging.WARNING, logger="burncoll.transport"):
        run(body())
    lines = [r.getMessage() for r in caplog.records if "dropped the oldest" in r.getMessage()]
    assert len(lines) == LOG_BURST + 1, lines
    assert all("from A" in line for line in lines)
    assert f"(and {499 - LOG_BURST} more like it" in lines[-1]


# -- against a real listener ---------------------------------------------------------------------

async def _stranger(port: int, source: str) -> socket.socket:
    """A connection from ``source`` that says nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    return sock


async def _strangers(port: int, sources: list[str]) -> list[socket.socket]:
    socks = []
    for source in sources:
        socks.append(await _stranger(port, source))
    await asyncio.sleep(0.1)  # all accepted (and the oldest evicted)
    return socks


async def _is_closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while True:
                data = await loop.sock_recv(sock, 4096)
                if not data:
                    return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _legitimate_exchange(transport: Transport, port: int,
                               accepted: asyncio.Queue[Connection]) -> None:
    """What a node does: connect, a short exchange standing for authentication, then a
    message far over the pre-authentication budget."""
    client = await transport.connect(HOST, port)
    try:
        server = await asyncio.wait_for(accepted.get(), 5)
        await server.send([b"challenge"])
        assert await _recv_bytes(client, 5) == b"challenge"
        client.authenticated()
        await client.send([b"response"])
        assert await _recv_bytes(server, 5) == b"response"
        server.authenticated()
        payload = os.urandom(1 << 20)
        await client.send([payload])
        assert await _recv_bytes(server, 5) == payload
    finally:
        await client.close()


@pytest.mark.parametrize("make", STREAM_TRANSPORTS)
def test_a_node_registers_while_200_idle_strangers_hold_every_pending_slot(
        make: Callable[..., Transport]) -> None:
    async def body() -> None:
        transport = make()
        async with serving(transport) as served:
            # 20 sources x 10: under the per-source cap, far over the overall one
            strangers = await _strangers(served.port, [f"127.0.0.{2 + i % 20}"
                                                       for i in range(200)])
            try:
                listener = served.listener
                assert isinstance(listener, StreamListener)
                assert listener.admission.pending <= listener.admission.max_pending
                await _legitimate_exchange(transport, served.port, served.accepted)
                closed = await asyncio.gather(*(_is_closed(s, 0.5) for s in strangers))
                # the oldest were evicted; the newest still wait (for the deadline)
                assert sum(closed) >= 200 - listener.admission.max_pending
                assert not all(closed[-10:])
            finally:
                for sock in strangers:
                    sock.close()

    run(body())


@pytest.mark.parametrize("make", STREAM_TRANSPORTS)
def test_a_source_over_its_cap_evicts_only_its_own_connections(
        make: Callable[..., Transport]) -> None:
    async def body() -> None:
        transport = make()
        async with serving(transport) as served:
            bystander = await _stranger(served.port, "127.0.0.3")
            flood = await _strangers(served.port, ["127.0.0.2"] * 40)
            try:
                closed = await asyncio.gather(*(_is_closed(s, 0.3) for s in flood))
                assert sum(closed) == 40 - 16  # max_pending_per_source stay
                assert not await _is_closed(bystander, 0.1)
            finally:
                for sock in [bystander, *flood]:
                    sock.close()

    run(body())


@pytest.mark.parametrize("make", STREAM_TRANSPORTS)
def test_idle_connections_are_dropped_at_the_preauth_deadline(
        make: Callable[..., Transport]) -> None:
    async def body() -> None:
        preauth = 0.3
        transport = make(admission=lambda: Admission(preauth_seconds=preauth))
        errors: list[str] = []

        async def handler(conn: Connection) -> None:
            try:
                await conn.recv()
            except TransportError as exc:
                errors.append(str(exc))

        async with serving(transport, handler) as served:
            silent = await _strangers(served.port, ["127.0.0.2"] * 3)
            # opened (the handler runs) but never authenticates
            opened = await transport.connect(HOST, served.port)
            try:
                await asyncio.sleep(0.05)
                started = asyncio.get_running_loop().time()
                assert all(await asyncio.gather(*(_is_closed(s, 2) for s in silent)))
                with pytest.raises(TransportError):
                    await asyncio.wait_for(opened.recv(), 2)
                # by the deadline (room for a loaded machine), not never
                assert asyncio.get_running_loop().time() - started < 10 * preauth
                await asyncio.sleep(0.05)
                assert len(errors) == 1 and "not authenticated within 0.3 s" in errors[0]
            finally:
                await opened.close()
                for sock in silent:
                    sock.close()

    run(body())


@pytest.mark.parametrize("make", STREAM_TRANSPORTS)
def test_over_max_connections_a_connection_is_refused_and_logged(
        make: Callable[..., Transport], caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        transport = make(admission=lambda: Admission(max_connections=2))
        async with serving(transport) as served:
            first = await transport.connect(HOST, served.port)
            second = await transport.connect(HOST, served.port)
            for conn in (first, second, await served.accepted.get(), await served.accepted.get()):
                conn.authenticated()
            try:
                with pytest.raises(TransportError):
                    refused = await transport.connect(HOST, served.port)
                    try:
                        await asyncio.wait_for(refused.recv(), 2)  # tcp: connected, then closed
                    finally:
                        await refused.close()
                await first.close()
                await asyncio.sleep(0.1)
                third = await transport.connect(HOST, served.port)  # room again
                third.authenticated()
                await third.send([b"hello"])
                assert await _recv_bytes((await served.accepted.get()), 2) == b"hello"
                await third.close()
            finally:
                await first.close()
                await second.close()

    with caplog.at_level(logging.WARNING, logger="burncoll.transport"):
        run(body())
    assert any("refused a connection from 127.0.0.1" in r.getMessage()
               and "max_connections" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("make", STREAM_TRANSPORTS)
def test_closing_the_listener_drops_the_strangers_still_waiting(
        make: Callable[..., Transport]) -> None:
    async def body() -> None:
        transport = make()
        async with serving(transport) as served:
            strangers = await _strangers(served.port, ["127.0.0.2"] * 3)
            assert served.listener is not None
            await served.listener.close()
            try:
                assert all(await asyncio.gather(*(_is_closed(s, 1) for s in strangers)))
            finally:
                for sock in strangers:
                    sock.close()

    run(body())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_wss_admits_a_connection_before_its_tls_handshake() -> None:
    """300 silent TCP connections to a wss listener (from 20 addresses, under the per-source
    cap) never hold more than ``max_pending`` pending places, the evicted ones' descriptors are
    closed, and a node authenticates (the real exchange) and sends a MiB meanwhile. Before the
    fix each silent connection sat in the TLS handshake, counted by nothing, for 10 s."""
    token = "a token for this test"
    settings = TlsSettings(ephemeral=True)

    async def handler(conn: Connection) -> None:
        conn = await authenticate_server(conn, token, 5)
        message = await _recv_bytes(conn, 10)
        await conn.send([message[::-1]])
        await asyncio.sleep(0.5)  # let the reply leave before the handler closes

    async def node(port: int) -> None:
        client = await WebSocketTransport(tls=settings).connect(HOST, port)
        try:
            conn = await authenticate_client(client, token, 5)
            payload = os.urandom(1 << 20)
            await conn.send([payload])
            assert await _recv_bytes(conn, 10) == payload[::-1]
        finally:
            await client.close()

    async def body() -> None:
        async with serving(WebSocketTransport(tls=settings), handler) as served:
            listener = served.listener
            assert isinstance(listener, StreamListener)
            admission = listener.admission
            before = _open_fds()
            sources = [f"127.0.0.{2 + i % 20}" for i in range(300)]
            strangers, _ = await asyncio.gather(_strangers(served.port, sources),
                                                node(served.port))
            try:
                assert admission.pending <= admission.max_pending
                # ours: 300 client sockets; the listener's: at most max_pending (and the
                # node's, closing); before the fix, 300 more
                assert _open_fds() - before <= 300 + admission.max_pending + 4
                closed = await asyncio.gather(*(_is_closed(s, 0.5) for s in strangers))
                assert sum(closed) >= 300 - admission.max_pending
            finally:
                for sock in strangers:
                    sock.close()

    run(body())
