"""The shared-memory ring between two nodes of one host (``burncoll.transport.shm``), over real
connections of each protocol: every message arrives whole and in order however often the ring
wraps, a slow receiver holds its sender back, large payloads land where a placer says, a
closed connection fails both sides at once, hostile descriptors and offers are refused (an
unsealed ring above all: a shrunk one would crash its receiver), nobody can resize a ring, and
its descriptor is closed once the receiver has mapped it. Then real nodes: in-process nodes of
this host choose the ring, and ``shared_memory=False`` keeps them on the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct
from collections.abc import AsyncIterator, Callable
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


async def _sent_and_received(sender: shm.RingSender, receiver: shm.RingReceiver,
                             parts: list[bytes]) -> Any:
    """Send one message and receive it (the first large one waits for the receiver to answer
    the ring's offer, which it does as it reads)."""
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
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
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
    assert _rings() <= before  # acknowledged: the sender closed the ring's descriptor


def test_payloads_land_where_the_placer_says() -> None:
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
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
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
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
                        sender._ring[start:end] = b"\x5a" * (end - start)

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
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            target = bytearray(1 << 20)

            def placer(first: memoryview, size: int) -> tuple[int, memoryview]:
                judged.append(bytes(first[:16]))
                sender._ring[0:16] = b"X" * 16  # rewritten as the receiver works
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
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
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


@contextlib.asynccontextmanager
async def _made_ring() -> AsyncIterator[tuple[Connection, shm.RingReceiver, shm.RingSender, str]]:
    """A TCP connection whose sending side has made its ring, not offered yet: the sending
    end's connection, both ring ends, and the ring's name."""
    from burncoll.transport.tcp import TcpTransport

    async with connected(TcpTransport()) as (client, server, _):
        receiver, sender = shm.RingReceiver(client), shm.RingSender(server)
        sender._create()
        try:
            yield server, receiver, sender, sender._offer
        finally:
            await sender.close()


#: A pid no process has (above the kernel's largest).
_DEAD_PID = 2**22 + 7


def _offer(text: str) -> bytes:
    return b"BSO1" + struct.pack("<Q", shm.RING_BYTES) + text.encode()


def _hostile(build: Callable[[str], bytes]) -> BaseException:
    async def main() -> BaseException:
        async with _made_ring() as (server, receiver, _sender, name):
            await server.send([build(name)])
            try:
                await asyncio.wait_for(receiver.recv(), 10)
            except (ProtocolError, TransportError) as exc:
                return exc
            raise AssertionError("accepted")

    return run(main())


@pytest.mark.parametrize(("what", "build"), [
    ("a descriptor before any ring", lambda name: b"BSD1" + struct.pack("<Q", 1 << 20)),
    ("an offer of another size", lambda name: b"BSO1" + struct.pack("<Q", 4096) + name.encode()),
    ("an offer of a path", lambda name: _offer("../../etc/passwd")),
    ("an offer of a pid alone", lambda name: _offer(name.split("/")[0])),
])
def test_hostile_offers_and_descriptors_are_refused(what: str,
                                                    build: Callable[[str], bytes]) -> None:
    error = _hostile(build)
    assert isinstance(error, ProtocolError), (what, error)


def test_a_descriptor_larger_than_the_ring_allows_is_refused() -> None:
    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, name):
            await server.send([_offer(name)])
            await server.send([b"BSD1" + struct.pack("<Q", shm.RING_BYTES)])
            with pytest.raises(ProtocolError, match="does not accept"):
                await asyncio.wait_for(receiver.recv(), 10)

    run(main())


@pytest.mark.parametrize(("what", "offer"), [
    ("its sender has ended", lambda name: f"{_DEAD_PID}/{name.split('/', 1)[1]}"),
    ("its number names another file now", lambda name: f"{os.getpid()}/0/{name[-32:]}"),
    ("it is under another name", lambda name: name[:-32] + "f" * 32),
])
def test_a_ring_that_cannot_be_reached_is_declined_and_the_connection_reads_on(
        what: str, offer: Callable[[str], str]) -> None:
    """A sender that fails may end (or close its ring) before its receiver maps the ring;
    what it said before closing comes after the offer, and must still be read, for the
    receiver to learn why. The receiver declines the ring and reads on; the connection fails
    only when it ends."""
    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, name):
            await server.send([_offer(offer(name))])
            await server.send([b"the reason it failed"])
            got = await asyncio.wait_for(receiver.recv(), 10)
            assert bytes(got) == b"the reason it failed", what
            assert bytes(await asyncio.wait_for(server.recv(), 10)) == b"BSN1", what
            await server.close()
            with pytest.raises(TransportError):
                await asyncio.wait_for(receiver.recv(), 10)
            await receiver.close()

    run(main())


def test_a_declined_ring_leaves_every_message_on_the_connection() -> None:
    """The sender waits for the answer before anything goes through the ring: declined,
    large messages travel on the connection, whole and in order, and the ring is let go."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport(max_message_bytes=64 << 20)) as (client, server, _):
            sender = shm.RingSender(server)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            sizes = [shm.MIN_BYTES, 10, 3 << 20, shm.MAX_BYTES]

            async def send_all() -> None:  # (one writer at a time, as a node sends)
                for i, n in enumerate(sizes):
                    await sender.send([_message(i, n)])

            sending = asyncio.ensure_future(send_all())
            offer = bytes(await asyncio.wait_for(client.recv(), 10))
            assert offer[:4] == b"BSO1" and not sending.done()  # waiting for the answer
            await client.send([b"BSN1"])
            await asyncio.wait_for(sending, 10)
            for i, n in enumerate(sizes):
                got = await asyncio.wait_for(client.recv(), 10)
                assert bytes(got) == _message(i, n), i
            assert sender._fd is None and _rings() == set()
            await sender.close()
            reading.cancel()

    run(main())


@pytest.mark.parametrize("answers", [
    [b"BSA1" + struct.pack("<Q", 1)],  # an acknowledgement before any answer
    [b"BSM1", b"BSM1"],  # answered twice
    [b"BSN1", b"BSM1"],  # declined, then mapped after all
])
def test_a_receiver_that_breaks_the_offer_protocol_fails_the_waiting_send(
        answers: list[bytes]) -> None:
    """A hostile receiver's answers are checked; one that breaks the protocol fails the
    connection, and a send waiting for the answer (or for room) fails with it at once."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender = shm.RingSender(server)
            reading = asyncio.ensure_future(sender.recv())
            sending = asyncio.ensure_future(sender.send([_message(1, shm.MIN_BYTES)]))
            assert bytes(await asyncio.wait_for(client.recv(), 10))[:4] == b"BSO1"
            for answer in answers:
                await client.send([answer])
            with pytest.raises(ProtocolError):
                await asyncio.wait_for(reading, 10)
            if not sending.done() or sending.exception() is not None:
                with pytest.raises(TransportError, match="ProtocolError"):
                    await asyncio.wait_for(sending, 10)
            await sender.close()

    run(main())


def test_an_answer_without_an_offer_is_refused() -> None:
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender = shm.RingSender(server)
            await client.send([b"BSM1"])
            with pytest.raises(ProtocolError, match="not offered"):
                await asyncio.wait_for(sender.recv(), 10)
            await sender.close()

    run(main())


@pytest.mark.parametrize("then", [
    lambda name: b"BSD1" + struct.pack("<Q", shm.MIN_BYTES),  # a descriptor after a decline
    lambda name: _offer(name),  # a second offer
])
def test_after_a_decline_no_descriptor_or_offer_is_accepted(
        then: Callable[[str], bytes]) -> None:
    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, name):
            await server.send([_offer(f"{_DEAD_PID}/{name.split('/', 1)[1]}")])
            await server.send([then(name)])
            with pytest.raises(ProtocolError, match="does not accept"):
                await asyncio.wait_for(receiver.recv(), 10)

    run(main())


def test_a_failed_session_wakes_a_send_waiting_for_the_answer() -> None:
    """A receiver that never answers (stuck, hostile) must not hold the send -- and the
    member's send lock the abort needs -- until the connection ends."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender = shm.RingSender(server)
            sending = asyncio.ensure_future(sender.send([_message(1, shm.MIN_BYTES)]))
            assert bytes(await asyncio.wait_for(client.recv(), 10))[:4] == b"BSO1"
            await asyncio.sleep(0.05)
            assert not sending.done()
            sender.abandon(ProtocolError("the session failed"))
            with pytest.raises(TransportError, match="the session failed"):
                await asyncio.wait_for(sending, 10)
            await sender.send([b"an abort"])  # small messages still go on the connection
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


def test_a_ring_is_let_go_once_answered_and_at_close() -> None:
    """The sender closes the ring's descriptor when the receiver has answered, and at close
    if it never did: no ring is held past its connection."""
    from burncoll.transport.tcp import TcpTransport

    async def main() -> None:
        async with connected(TcpTransport()) as (client, server, _):
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
            reading = asyncio.ensure_future(_acks(sender, asyncio.Event()))
            got = await _sent_and_received(sender, receiver, [_message(1, shm.MIN_BYTES)])
            assert sender._mapped is True and sender._fd is None  # offered, mapped, sent
            assert isinstance(got, Placed) and bytes(got.payload) == _message(1, shm.MIN_BYTES)
            del got  # (a lent payload is the ring's memory: it keeps the mapping open)
            await sender.close()
            await receiver.close()
            reading.cancel()
        assert _rings() == set()  # (a mapping holds a descriptor of its own until closed)
        async with connected(TcpTransport()) as (client, server, _):
            sender = shm.RingSender(server)
            offering = asyncio.ensure_future(sender.send([_message(2, shm.MIN_BYTES)]))
            await asyncio.wait_for(client.recv(), 10)  # the offer, never answered
            assert sender._fd is not None
            await sender.close()
            assert sender._fd is None and _rings() == set()
            with pytest.raises(TransportError):
                await asyncio.wait_for(offering, 10)

    run(main())


def test_nobody_can_resize_a_ring() -> None:
    """Not its creator, not another opener of it: its size is sealed, so no receiver's
    mapping can lose its pages."""
    async def main() -> None:
        async with _made_ring() as (_server, _receiver, sender, _name):
            assert sender._fd is not None
            other = os.open(f"/proc/self/fd/{sender._fd}", os.O_RDWR)
            try:
                for fd in (sender._fd, other):
                    for size in (0, shm.RING_BYTES // 2, 2 * shm.RING_BYTES):
                        with pytest.raises(PermissionError):
                            os.ftruncate(fd, size)
                assert os.fstat(other).st_size == shm.RING_BYTES
            finally:
                os.close(other)

    run(main())


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
            kinds = {type(c).__name__ for c in service.connections.out.values()}
            comm.finish()
            out[node] = (result, kinds)

        threads = [threading.Thread(target=peer, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    return out


@pytest.mark.parametrize("shared_memory", [True, False])
def test_nodes_of_one_host_choose_the_ring_unless_told_not_to(shared_memory: bool) -> None:
    before = _rings()
    results = _two_nodes(shared_memory)
    want = np.arange(3 << 20, dtype=np.float32) * 3
    for node in range(2):
        result, kinds = results[node]
        np.testing.assert_array_equal(result, want)
        assert ("RingSender" in kinds) is shared_memory and len(kinds) == 1, kinds
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
