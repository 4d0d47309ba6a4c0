"""The stream regions between two nodes of one host (``burncoll.transport.shm``), over real
connections of each protocol, each region a real sealed host file as the host memory hands
it in (``burncoll.node.host_memory``): every message arrives whole and in order however often
the region wraps, a slow receiver holds its sender back, large payloads land where a placer
says, a closed connection or a failed session fails a waiting sender at once, hostile
descriptors and acknowledgements are refused, hostile files are refused (an unsealed one
above all: a shrunk one would crash its receiver), and nobody can resize one. Then real nodes:
in-process nodes of this host send through their regions, and ``shared_memory=False`` keeps
them on the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import struct
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import Placed
from burncoll.transport import host_files, shm
from burncoll.transport.base import Connection
from tests.transport.support import EACH_PROTOCOL, MakeTransport, connected, run

SIZES = [10, shm.MIN_BYTES - 1, shm.MIN_BYTES, 3 << 20, shm.MAX_BYTES, shm.MAX_BYTES + 1,
         5 << 20, 1 << 20, 7 << 20]


@pytest.fixture(autouse=True)
def _rings_of_others() -> None:
    """The rings open before the test (a session another test of this process has not closed
    yet may hold one) are not this test's."""
    _OTHERS.clear()
    _OTHERS.update(_rings())


_OTHERS: set[str] = set()


def _rings() -> set[str]:
    """The rings this process has open descriptors of (mappings hold no descriptor), except
    those open before the test."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            name = os.readlink(f"/proc/self/fd/{fd}")
            if name.startswith("/memfd:burncoll-") and "probe" not in name:
                names.add(name)
    return names - _OTHERS


def _message(i: int, size: int) -> bytes:
    return (np.arange(size, dtype=np.uint8) + i).tobytes()


async def _acks(conn: Connection, stop: asyncio.Event) -> None:
    """The sending side reads its connection (where the acknowledgements arrive)."""
    while not stop.is_set():
        try:
            await conn.recv()
        except (TransportError, asyncio.CancelledError):
            return


def _ends(client: Connection, server: Connection) -> tuple[shm.RingSender, shm.RingReceiver]:
    """The two ends of a connection (``server`` sends), with a stream region as the host
    memory hands them theirs: a sealed host file, mapped writable by the sender and, found as
    another node finds it (``map_offered``), read-only by the receiver."""
    token = secrets.token_hex(16)
    fd, mapping = host_files.new_host_file(token, shm.RING_BYTES)
    try:
        reading = host_files.map_offered(os.getpid(), fd, token, shm.RING_BYTES)
    finally:
        os.close(fd)
    assert reading is not None
    sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
    sender.attach(memoryview(mapping))
    receiver.attach(memoryview(reading))
    return sender, receiver


async def _sent_and_received(sender: shm.RingSender, receiver: shm.RingReceiver,
                             parts: list[bytes]) -> Any:
    """Send one message and receive it."""
    sending = asyncio.ensure_future(sender.send(parts))
    message = await asyncio.wait_for(receiver.recv(), 10)
    await asyncio.wait_for(sending, 10)
    return message


@pytest.mark.parametrize("make", EACH_PROTOCOL)
def test_every_message_arrives_whole_and_in_order_through_the_ring(
        make: MakeTransport) -> None:
    before = _rings()

    async def main() -> None:
        async with connected(make(max_message_bytes=64 << 20)) as (client, server, _):
            sender, receiver = _ends(client, server)
            stop = asyncio.Event()
            reading = asyncio.ensure_future(_acks(sender, stop))
            sizes = SIZES * 4  # 4 rounds of ~50 MiB through a 20 MiB ring
            got: list[bytes] = []

            async def receive() -> None:
                for i in range(len(sizes)):
                    if i % 5 == 0:
                        await asyncio.sleep(0.05)  # a slow receiver: the sender must wait
                    message = await receiver.recv()
                    if isinstance(message, Placed):  # lent: the ring's memory, whole
                        assert message.lent and message.head == b""
                        message = message.payload  # (read before the next recv)
                    got.append(bytes(message))

            receiving = asyncio.ensure_future(receive())
            for i, size in enumerate(sizes):
                await sender.send([_message(i, size)[:size // 2], _message(i, size)[size // 2:]])
            await asyncio.wait_for(receiving, 60)
            assert [len(g) for g in got] == sizes
            for i, (g, size) in enumerate(zip(got, sizes, strict=True)):
                assert g == _message(i, size), i
            stop.set()
            await sender.close()
            reading.cancel()

    run(main(), 120)
    assert _rings() <= before  # (a region's mapping holds no descriptor)


def test_payloads_land_where_the_placer_says() -> None:
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = _ends(client, server)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            target = bytearray(1 << 20)
            receiver.place_with(lambda first, size: (16, memoryview(target)[:size - 16])
                                if size == (1 << 20) + 16 else None)
            payload = _message(3, 1 << 20)
            message = await _sent_and_received(sender, receiver, [b"H" * 16, payload])
            assert isinstance(message, Placed) and message.head == b"H" * 16
            assert bytes(target) == payload
            await sender.close()
            reading.cancel()

    run(main())


def test_nothing_is_read_from_the_ring_once_it_is_acknowledged() -> None:
    """The sender (another process) may reuse acknowledged ring bytes at once. A test double
    scribbles over the whole ring the moment an acknowledgement leaves the receiver; every
    message must still arrive whole: placed ones (their header too), and lent ones read
    before the next ``recv``."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = _ends(client, server)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            sent = [(b"P" if i % 2 else b"L") + bytes([i]) * 15 + _message(i, 3 << 20)
                    for i in range(12)]
            regions: list[tuple[int, int, int]] = []  # each message's bytes, its ring use
            position = total = 0
            for message in sent:
                start, used = shm._advance(position, len(message))
                position, total = start + len(message), total + used
                regions.append((start, start + len(message), total))
            acknowledge, acked = client.send, [0]

            async def acknowledge_then_scribble(parts: Any) -> None:
                await acknowledge(parts)
                if bytes(parts[0][:4]) == b"BSA1":  # what the sender may now reuse: all of it
                    acked[0] += struct.unpack_from("<Q", parts[0], 4)[0]
                    while regions and regions[0][2] <= acked[0]:  # (each once: reused later)
                        start, end, _ = regions.pop(0)
                        sender._region[start:end] = b"\x5a" * (end - start)

            client.send = acknowledge_then_scribble  # type: ignore[method-assign]
            receiver.place_with(lambda first, size: (16, memoryview(bytearray(size - 16)))
                                if bytes(first[:1]) == b"P" else None)

            async def receive() -> list[bytes]:
                got = []
                for _ in sent:
                    message = await receiver.recv()
                    assert isinstance(message, Placed)
                    got.append(message.head + bytes(message.payload))
                return got

            receiving = asyncio.ensure_future(receive())
            for message in sent:
                await sender.send([message])
            got = await asyncio.wait_for(receiving, 60)
            assert [g[:16] for g in got] == [m[:16] for m in sent]
            assert got == sent
            await sender.close()
            reading.cancel()

    run(main())


def test_a_placed_message_carries_the_header_its_placer_judged() -> None:
    """The sender can rewrite the ring while the receiver reads it: the header delivered with
    a placed payload must be the one the placer chose the place by, not one re-read later."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = _ends(client, server)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            target = bytearray(1 << 20)

            def placer(first: memoryview, size: int) -> tuple[int, memoryview]:
                judged.append(bytes(first[:16]))
                sender._region[0:16] = b"X" * 16  # rewritten as the receiver works
                return 16, memoryview(target)

            judged: list[bytes] = []
            receiver.place_with(placer)
            message = await _sent_and_received(sender, receiver,
                                               [b"H" * 16, _message(4, 1 << 20)])
            assert isinstance(message, Placed) and not message.lent
            assert judged == [b"H" * 16] and message.head == b"H" * 16
            assert bytes(target) == _message(4, 1 << 20)
            await sender.close()
            reading.cancel()

    run(main())


def test_a_closed_connection_fails_a_sender_waiting_for_room() -> None:
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = _ends(client, server)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            await _sent_and_received(sender, receiver, [_message(0, shm.MAX_BYTES)])
            for i in range(1, shm.RING_BYTES // shm.MAX_BYTES):  # (none acknowledged)
                await sender.send([_message(i, shm.MAX_BYTES)])
            third = asyncio.ensure_future(sender.send([_message(9, shm.MAX_BYTES)]))
            await asyncio.sleep(0.2)
            assert not third.done()  # the ring is full until the receiver consumes
            await receiver.close()
            with pytest.raises(TransportError):
                await asyncio.wait_for(third, 10)
            reading.cancel()
            await sender.close()

    run(main())


def _refused(message: bytes, region: bool = True) -> BaseException:
    """What the receiving end (with its region, or without one) makes of ``message``."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> BaseException:
        async with connected(TcpTransport()) as (client, server, _):
            receiver = _ends(client, server)[1] if region else shm.RingReceiver(client)
            await server.send([message])
            try:
                await asyncio.wait_for(receiver.recv(), 10)
            except (ProtocolError, TransportError) as exc:
                return exc
            raise AssertionError("accepted")

    return run(main())


@pytest.mark.parametrize(("what", "message", "region"), [
    ("a descriptor without a region", b"BSD1" + struct.pack("<Q", shm.MIN_BYTES), False),
    ("a descriptor larger than a region allows",
     b"BSD1" + struct.pack("<Q", shm.MAX_BYTES + 1), True),
    ("a descriptor of the whole region", b"BSD1" + struct.pack("<Q", shm.RING_BYTES), True),
    ("a descriptor below the region's size", b"BSD1" + struct.pack("<Q", 10), True),
    ("a descriptor cut short", b"BSD1" + struct.pack("<Q", shm.MIN_BYTES)[:5], True),
])
def test_hostile_descriptors_are_refused(what: str, message: bytes, region: bool) -> None:
    error = _refused(message, region)
    assert isinstance(error, ProtocolError) and "does not accept" in str(error), (what, error)


@pytest.mark.parametrize(("what", "ack", "region"), [
    ("without a region", b"BSA1" + struct.pack("<Q", 1), False),
    ("of more than was sent", b"BSA1" + struct.pack("<Q", 1), True),
    ("of nothing", b"BSA1" + struct.pack("<Q", 0), True),
    ("cut short", b"BSA1" + b"\x01", True),
])
def test_hostile_acknowledgements_are_refused_and_fail_a_waiting_send(
        what: str, ack: bytes, region: bool) -> None:
    """A hostile receiver's acknowledgements are checked; one that frees what was never sent
    fails the connection, and a send waiting for room fails with it at once."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender = _ends(client, server)[0] if region else shm.RingSender(server)
            reading = asyncio.ensure_future(sender.recv())
            await client.send([ack])
            with pytest.raises(ProtocolError, match="acknowledged"):
                await asyncio.wait_for(reading, 10)
            if region:
                with pytest.raises(TransportError, match="ProtocolError"):
                    for i in range(shm.RING_BYTES // shm.MAX_BYTES + 1):  # (past its room)
                        await asyncio.wait_for(sender.send([_message(i, shm.MAX_BYTES)]), 10)
            await sender.close()

    run(main())


def test_without_a_region_every_message_stays_on_the_connection() -> None:
    """A connection whose nodes share no host memory (declined at join, another host)."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport(max_message_bytes=64 << 20)) as (client, server, _):
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
            sizes = [shm.MIN_BYTES, 10, 3 << 20, shm.MAX_BYTES]
            for i, n in enumerate(sizes):
                got = await _sent_and_received(sender, receiver, [_message(i, n)])
                assert bytes(got) == _message(i, n), i
            await sender.close()

    run(main())


def test_a_failed_session_wakes_a_send_waiting_for_room() -> None:
    """A receiver that never consumes (stuck, hostile) must not hold the send -- and the
    member's send lock the abort needs -- until the connection ends."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, _receiver = _ends(client, server)
            for i in range(shm.RING_BYTES // shm.MAX_BYTES):  # (none acknowledged)
                await sender.send([_message(i, shm.MAX_BYTES)])
            sending = asyncio.ensure_future(sender.send([_message(9, shm.MAX_BYTES)]))
            await asyncio.sleep(0.05)
            assert not sending.done()
            sender.abandon(ProtocolError("the session failed"))
            with pytest.raises(TransportError, match="the session failed"):
                await asyncio.wait_for(sending, 10)
            await sender.send([b"an abort"])  # small messages still go on the connection
            for _ in range(shm.RING_BYTES // shm.MAX_BYTES):
                await asyncio.wait_for(client.recv(), 10)  # (the descriptors)
            assert bytes(await asyncio.wait_for(client.recv(), 10)) == b"an abort"
            await sender.close()

    run(main())


def _sealed_offer(token: str, flags: int = 0, seal: bool = True) -> int:
    """A ring-sized memfd named as a ring with ``token`` (``flags`` added; sealed or not)."""
    fd = os.memfd_create(f"burncoll-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, shm.RING_BYTES)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, host_files.SEALS)
    return fd


def test_an_unsealed_ring_is_refused() -> None:
    """A ring that could be shrunk under the receiver's mapping would crash it (SIGBUS on the
    next read): an offer of one -- right name, size and owner, no seals -- is refused."""
    token = "c" * 32
    fd = _sealed_offer(token, seal=False)
    try:
        with pytest.raises(ProtocolError, match="could still be resized"):
            host_files.map_offered(os.getpid(), fd, token, shm.RING_BYTES)
    finally:
        os.close(fd)


def test_a_huge_page_ring_is_refused() -> None:
    """A huge-page file can lose pages to a punched hole and fail the next fault (SIGBUS):
    only rings on the kernel's ordinary memfd filesystem are accepted."""
    token = "d" * 32
    try:
        fd = _sealed_offer(token, os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"no huge-page memfd here: {exc}")
    try:
        with pytest.raises(ProtocolError, match="not an ordinary anonymous file"):
            host_files.map_offered(os.getpid(), fd, token, shm.RING_BYTES)
    finally:
        os.close(fd)


_LEASE_HOLDER = """
import fcntl, os, signal, sys, time
from burncoll.transport import host_files
signal.signal(signal.SIGIO, signal.SIG_IGN)  # (a lease break would end this process)
fd = host_files.sealed_file("burncoll-" + "e" * 32, int(sys.argv[1]))
ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
os.close(fd)
fcntl.fcntl(ro, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print(ro, flush=True)
time.sleep(60)
"""


def test_a_ring_under_a_lease_is_refused_at_once() -> None:
    """Opening a file under another process's write lease blocks until the lease is broken
    (45 s by default), in the receiver's event loop: the receiver opens without waiting and
    refuses it."""
    import subprocess
    import sys
    import threading

    holder = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, str(shm.RING_BYTES)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        fd = int(holder.stdout.readline())
        outcome: list[BaseException | object] = []

        def receive() -> None:
            try:
                outcome.append(host_files.map_offered(holder.pid, fd, "e" * 32,
                                                      shm.RING_BYTES))
            except BaseException as exc:
                outcome.append(exc)

        opener = threading.Thread(target=receive, daemon=True)
        opener.start()
        opener.join(10)
        assert not opener.is_alive(), "the receiver waited on the lease"
        assert isinstance(outcome[0], ProtocolError), outcome
        assert "cannot be read from" in str(outcome[0]), outcome
    finally:
        holder.kill()
        holder.wait()


def test_nobody_can_resize_a_host_file() -> None:
    """Not its creator, not another opener of it: its size is sealed, so no receiver's
    mapping can lose its pages."""
    fd, mapping = host_files.new_host_file(secrets.token_hex(16), shm.RING_BYTES)
    other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        for each in (fd, other):
            for size in (0, shm.RING_BYTES // 2, 2 * shm.RING_BYTES):
                with pytest.raises(PermissionError):
                    os.ftruncate(each, size)
        assert os.fstat(other).st_size == shm.RING_BYTES
    finally:
        os.close(other)
        os.close(fd)
        host_files.close_host_file(mapping)


def _two_nodes(shared_memory: bool) -> dict[int, Any]:
    import threading

    out: dict[int, Any] = {}
    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        def peer(node: int) -> None:
            cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=node, num_devices=1,
                                            global_address=orch.address, timeout=20,
                                            shared_memory=shared_memory)
            comm = burncoll.register(node, 0, cfg)
            x = np.arange(3 << 20, dtype=np.float32) * (node + 1)
            result = comm.all_reduce(x)
            link = comm._server.link
            service = link._service  # type: ignore[union-attr]
            kinds = {(type(c).__name__, getattr(c, "_region", None) is not None)
                     for c in service.connections.out.values()}
            comm.finish()
            out[node] = (result, kinds)

        threads = [threading.Thread(target=peer, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    return out


@pytest.mark.parametrize("shared_memory", [True, False])
def test_nodes_of_one_host_send_through_their_regions_unless_told_not_to(
        shared_memory: bool) -> None:
    before = _rings()
    results = _two_nodes(shared_memory)
    want = np.arange(3 << 20, dtype=np.float32) * 3
    for node in range(2):
        result, kinds = results[node]
        np.testing.assert_array_equal(result, want)
        # (with a region handed in at join, or not wrapped at all)
        assert len(kinds) == 1 and (kinds == {("RingSender", True)}) is shared_memory, kinds
    assert _rings() <= before


def test_large_operations_among_three_nodes_of_one_host_are_exact_and_identical() -> None:
    """Real nodes through their rings, many times round them: parts reduced straight out of
    the ring, parts copied into their place, results fresh and into ``out=``; compared with
    a float64 reference and across nodes, bit for bit."""
    import threading

    count, nodes = 7 << 20, 3  # 28 MiB of float32: every ring wraps several times per call
    out: dict[int, Any] = {}
    with burncoll.start_orchestrator(expected_nodes=nodes) as orch:
        def peer(node: int) -> None:
            cfg = burncoll.CollectiveConfig(num_nodes=nodes, node_rank=node, num_devices=1,
                                            global_address=orch.address, timeout=60,
                                            global_all_reduce_strategy="ring")
            comm = burncoll.register(node, 0, cfg)
            got = []
            for i, op in enumerate(["sum", "max", "sum"]):
                x = np.random.default_rng([node, i]).standard_normal(count).astype(np.float32)
                into = np.empty_like(x)
                got.append(comm.all_reduce(x, op) if i != 1 else
                           comm.all_reduce(x, op, out=into))
            got.append(comm.all_gather(np.full(count // 8, node, np.float32)))
            comm.finish()
            out[node] = got

        threads = [threading.Thread(target=peer, args=(n,)) for n in range(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(out) == list(range(nodes))
    for i, op in enumerate(["sum", "max", "sum"]):
        xs = np.stack([np.random.default_rng([n, i]).standard_normal(count) for n in
                       range(nodes)]).astype(np.float32).astype(np.float64)
        want = xs.sum(axis=0) if op == "sum" else xs.max(axis=0)
        np.testing.assert_allclose(out[0][i], want, rtol=1e-5, atol=1e-5)
        for n in range(1, nodes):
            assert out[n][i].tobytes() == out[0][i].tobytes(), (op, n)
    gathered = np.repeat(np.arange(nodes, dtype=np.float64), count // 8)
    for n in range(nodes):
        np.testing.assert_array_equal(np.asarray(out[n][3]).reshape(-1), gathered)
