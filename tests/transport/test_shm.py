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
import os
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.errors import ProtocolError, TransportError
from burncoll.transport import shm
from burncoll.transport.base import Connection
from burncoll.transport.wire import Placed
from tests.transport.support import EACH_PROTOCOL, MakeTransport, connected, run

SIZES = [10, shm.MIN_BYTES - 1, shm.MIN_BYTES, 3 << 20, shm.MAX_BYTES, shm.MAX_BYTES + 1,
         5 << 20, 1 << 20, 7 << 20]


def _rings() -> set[str]:
    """The rings this process has open descriptors of (mappings hold no descriptor)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            name = os.readlink(f"/proc/self/fd/{fd}")
            if name.startswith("/memfd:burncoll-") and "probe" not in name:
                names.add(name)
    return names


def _message(i: int, size: int) -> bytes:
    return (np.arange(size, dtype=np.uint8) + i).tobytes()


async def _acks(conn: Connection, stop: asyncio.Event) -> None:
    """The sending side reads its connection (where the acknowledgements arrive)."""
    while not stop.is_set():
        try:
            await conn.recv()
        except (TransportError, asyncio.CancelledError):
            return


@pytest.mark.parametrize("make", EACH_PROTOCOL)
def test_every_message_arrives_whole_and_in_order_through_the_ring(
        make: MakeTransport) -> None:
    before = _rings()

    async def main() -> None:
        async with connected(make(max_message_bytes=64 << 20)) as (client, server, _):
            sender, receiver = shm.RingSender(server), shm.RingReceiver(client)
            stop = asyncio.Event()
            reading = asyncio.ensure_future(_acks(sender, stop))
            sizes = SIZES * 4  # 4 rounds of ~50 MiB through a 32 MiB ring
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
            await sender.send([b"H" * 16, payload])
            message = await receiver.recv()
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
            await sender.send([b"H" * 16, _message(4, 1 << 20)])
            message = await asyncio.wait_for(receiver.recv(), 10)
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
            for i in range(shm.RING_BYTES // shm.MAX_BYTES):
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
    ("an offer of a path", lambda name: b"BSO1" + struct.pack("<Q", shm.RING_BYTES)
     + b"../../etc/passwd"),
    ("an offer of a ring that is not there", lambda name: b"BSO1"
     + struct.pack("<Q", shm.RING_BYTES) + f"{_DEAD_PID}/3/{'0' * 32}".encode()),
    ("an offer of a ring under another name", lambda name: b"BSO1"
     + struct.pack("<Q", shm.RING_BYTES) + name[:-32].encode() + b"f" * 32),
    ("an offer of this process's standard input", lambda name: b"BSO1"
     + struct.pack("<Q", shm.RING_BYTES) + f"{os.getpid()}/0/{'0' * 32}".encode()),
])
def test_hostile_offers_and_descriptors_are_refused(what: str,
                                                    build: Callable[[str], bytes]) -> None:
    error = _hostile(build)
    assert isinstance(error, ProtocolError | TransportError), (what, error)


def test_a_descriptor_larger_than_the_ring_allows_is_refused() -> None:
    def build(name: str) -> bytes:
        return b"BSO1" + struct.pack("<Q", shm.RING_BYTES) + name.encode()

    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, name):
            await server.send([build(name)])
            await server.send([b"BSD1" + struct.pack("<Q", shm.RING_BYTES)])
            with pytest.raises(ProtocolError, match="does not accept"):
                await asyncio.wait_for(receiver.recv(), 10)

    run(main())


@pytest.mark.parametrize("ends", [False, True])
def test_a_ring_gone_before_it_was_mapped_lets_the_senders_last_words_through(ends: bool) -> None:
    """A sender that fails may end before its receiver maps the ring; what it said before
    closing comes after the offer (and a descriptor) on the connection, and must still be
    read, for the receiver to learn why -- then the connection fails, naming the ring: after
    a grace while it stays open, at once when it ends."""
    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, name):
            gone = f"{_DEAD_PID}/{name.split('/', 1)[1]}"  # as if its process had ended
            await server.send([b"BSO1" + struct.pack("<Q", shm.RING_BYTES) + gone.encode()])
            await server.send([b"BSD1" + struct.pack("<Q", shm.MIN_BYTES)])
            await server.send([b"the reason it failed"])
            got = await asyncio.wait_for(receiver.recv(), 10)
            assert bytes(got) == b"the reason it failed"
            if ends:
                await server.close()
            with pytest.raises(TransportError, match=f"could not map .*{gone}"):
                await asyncio.wait_for(receiver.recv(), 10)
            await receiver.close()

    run(main())


def test_an_unsealed_ring_is_refused() -> None:
    """A ring that could be shrunk under the receiver's mapping would crash it (SIGBUS on the
    next read): an offer of one -- right name, size and owner, no seals -- is refused."""
    async def main() -> None:
        async with _made_ring() as (server, receiver, _sender, _name):
            token = "c" * 32
            fd = os.memfd_create(f"burncoll-{token}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, shm.RING_BYTES)
                offer = f"{os.getpid()}/{fd}/{token}".encode()
                await server.send([b"BSO1" + struct.pack("<Q", shm.RING_BYTES) + offer])
                with pytest.raises(ProtocolError, match="could still be resized"):
                    await asyncio.wait_for(receiver.recv(), 10)
            finally:
                os.close(fd)

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
