"""One-way payload throughput of the transports over loopback, against their baselines.

For each case a receiver process listens on 127.0.0.1; this process connects, sends
``--messages`` messages of ``--size`` bytes, and waits for the receiver's one-byte
acknowledgement that it holds them all, whole. A round's throughput is payload bytes over
that time; the table shows the median (and range) of ``--rounds`` rounds after one warm-up.

Cases: burncoll's WebSocket, QUIC and TCP transports, each after the token authentication and
in each security mode (TLS with an ephemeral certificate, per-message integrity tags); "(server
sends)": the listening side sends and this process times what it receives -- the direction
burncoll's nodes send arrays in (server frames are not masked; a client must mask every frame,
which "websocket" pays for); a bare aioquic stream (aioquic's own
``StreamReader``/``StreamWriter`` adapters) with the same datagram size and flow-control
windows but default UDP socket buffers; and plain asyncio TCP streams, one ``readexactly`` per
message (the simplest Python baseline: it copies each 16 MiB message whole, so it is not a
ceiling). The two ends are pinned to different CPUs when there are two; loopback TCP results
still vary from run to run.

    python benchmarks/transport_throughput.py [--size MiB] [--messages N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import ssl
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

HOST = "127.0.0.1"
MiB = 1024 * 1024
_LEN = 8


# -- burncoll transports ----------------------------------------------------------------------
#
# Both ends authenticate first (burncoll.transport.auth), as nodes do: the pre-authentication
# limits are lifted only then, and the security mode (TLS, per-message integrity) is the one a
# node would use.

TOKEN = "transport benchmark token of enough length"


@dataclass(frozen=True)
class Mode:
    """One burncoll case: its transport, security, and which end sends."""

    transport: str
    tls: bool = False
    integrity: bool = False
    #: The listening side sends (the direction burncoll's nodes send arrays in).
    server_sends: bool = False

    def make(self) -> Any:
        from burncoll.transport import TlsSettings, get_transport

        return get_transport(self.transport, tls=TlsSettings(ephemeral=self.tls))


MODES = {
    "websocket": Mode("websocket"),
    "websocket (server sends)": Mode("websocket", server_sends=True),
    "websocket + integrity (server sends)": Mode("websocket", integrity=True, server_sends=True),
    "wss, ephemeral cert (server sends)": Mode("websocket", tls=True, server_sends=True),
    "tcp": Mode("tcp"),
    "tcp + integrity": Mode("tcp", integrity=True),
    "quic": Mode("quic"),
}


async def _stream(conn: Any, sends: bool, payload: bytes, messages: int) -> None:
    """One round on an authenticated connection: the receiving end says go, the sending end
    sends ``messages`` messages, and the receiving end acknowledges once it holds them all
    (so the round ends on both sides only when every byte has arrived)."""
    header = bytes(68)
    if sends:
        await conn.recv()  # go
        for _ in range(messages):
            await conn.send([header, payload])
        await conn.recv()  # all received
    else:
        await conn.send([b"go"])
        for _ in range(messages):
            await conn.recv()
        await conn.send([b"a"])


async def _burncoll_listener(mode: Mode, messages: int, rounds: int, pipe: Pipe,
                             payload: bytes) -> None:
    from burncoll.transport.auth import authenticate_server

    done = asyncio.Event()

    async def handler(conn: Any) -> None:
        conn = await authenticate_server(conn, TOKEN, 30.0, integrity=mode.integrity)
        for _ in range(rounds):
            await _stream(conn, mode.server_sends, payload, messages)
        done.set()

    listener = await mode.make().listen(HOST, 0, handler)
    pipe.send(listener.port)
    await done.wait()
    await listener.close()


async def _burncoll_dialer(mode: Mode, port: int, payload: bytes, messages: int) -> Runner:
    from burncoll.transport.auth import authenticate_client

    conn = await mode.make().connect(HOST, port)
    conn = await authenticate_client(conn, TOKEN, 30.0, integrity=mode.integrity)

    async def one_round() -> None:
        await _stream(conn, not mode.server_sends, payload, messages)

    return one_round, conn.close


# -- bare aioquic -----------------------------------------------------------------------------


def _aioquic_configuration(is_client: bool) -> Any:
    from aioquic.quic.configuration import QuicConfiguration

    from burncoll.transport.quic import MAX_DATAGRAM_SIZE
    from burncoll.transport.tls import make_self_signed

    window = 128 * MiB
    config = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=["bench"],
        max_datagram_size=MAX_DATAGRAM_SIZE,
        max_data=window,
        max_stream_data=window,
    )
    if is_client:
        config.verify_mode = ssl.CERT_NONE
    else:
        config.load_cert_chain(*make_self_signed(HOST))
    return config


async def _aioquic_receiver(messages: int, rounds: int, pipe: Pipe) -> None:
    from aioquic.asyncio.server import serve

    done = asyncio.Event()

    async def consume(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(rounds):
            for _ in range(messages):
                size = int.from_bytes(await reader.readexactly(_LEN), "little")
                await reader.readexactly(size)
            writer.write(b"a")
        done.set()

    tasks: set[asyncio.Task[None]] = set()

    def on_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.ensure_future(consume(reader, writer)))

    server = await serve(
        HOST, 0, configuration=_aioquic_configuration(False), stream_handler=on_stream
    )
    udp = server._transport
    assert udp is not None
    pipe.send(udp.get_extra_info("sockname")[1])
    await done.wait()
    await asyncio.sleep(0.2)  # let the last acknowledgement leave
    server.close()


async def _aioquic_sender(port: int, payload: bytes, messages: int) -> Runner:
    from aioquic.asyncio.client import connect

    client = connect(HOST, port, configuration=_aioquic_configuration(True))
    protocol = await client.__aenter__()
    reader, writer = await protocol.create_stream()
    prefix = (68 + len(payload)).to_bytes(_LEN, "little") + bytes(68)

    async def one_round() -> None:
        for _ in range(messages):
            writer.write(prefix)
            writer.write(payload)
        await reader.readexactly(1)

    async def close() -> None:
        await client.__aexit__(None, None, None)

    return one_round, close


# -- plain asyncio TCP ------------------------------------------------------------------------


async def _tcp_receiver(messages: int, rounds: int, pipe: Pipe) -> None:
    done = asyncio.Event()

    async def consume(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(rounds):
            for _ in range(messages):
                size = int.from_bytes(await reader.readexactly(_LEN), "little")
                await reader.readexactly(size)
            writer.write(b"a")
            await writer.drain()
        done.set()

    server = await asyncio.start_server(consume, HOST, 0, limit=64 * MiB)
    pipe.send(server.sockets[0].getsockname()[1])
    await done.wait()
    server.close()


async def _tcp_sender(port: int, payload: bytes, messages: int) -> Runner:
    reader, writer = await asyncio.open_connection(HOST, port)
    prefix = (68 + len(payload)).to_bytes(_LEN, "little") + bytes(68)

    async def one_round() -> None:
        for _ in range(messages):
            writer.write(prefix)
            writer.write(payload)
            await writer.drain()
        await reader.readexactly(1)

    async def close() -> None:
        writer.close()
        await writer.wait_closed()

    return one_round, close


# -- driver -----------------------------------------------------------------------------------

Runner = tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]
CASES = [*MODES, "aioquic (bare)", "asyncio TCP"]


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []


def _pin(cpu: int | None) -> None:
    """Run on ``cpu``: the two ends then never share a core, and results do not depend on
    where the scheduler happened to put them."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _receive(case: str, messages: int, rounds: int, pipe: Pipe, cpu: int | None,
             size: int = 0) -> None:
    _pin(cpu)
    if case in MODES:
        asyncio.run(_burncoll_listener(MODES[case], messages, rounds, pipe, os.urandom(size)))
    elif case == "aioquic (bare)":
        asyncio.run(_aioquic_receiver(messages, rounds, pipe))
    else:
        asyncio.run(_tcp_receiver(messages, rounds, pipe))


async def _send(case: str, port: int, payload: bytes, messages: int, rounds: int) -> list[float]:
    if case in MODES:
        one_round, close = await _burncoll_dialer(MODES[case], port, payload, messages)
    elif case == "aioquic (bare)":
        one_round, close = await _aioquic_sender(port, payload, messages)
    else:
        one_round, close = await _tcp_sender(port, payload, messages)
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        await one_round()
        rates.append(messages * len(payload) / (time.perf_counter() - started) / 1e9)
    await close()
    return rates[1:]  # the first round warms up (handshake windows, congestion control)


def measure(case: str, size: int, messages: int, rounds: int) -> list[float]:
    """GB/s of each measured round for ``case``."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    cpus = _cpus()
    sender_cpu, receiver_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    receiver = context.Process(
        target=_receive, args=(case, messages, rounds + 1, theirs, receiver_cpu, size)
    )
    receiver.start()
    try:
        if not ours.poll(60):
            raise RuntimeError(f"{case}: the receiver did not start")
        port = ours.recv()
        payload = os.urandom(size)
        _pin(sender_cpu)
        return asyncio.run(_send(case, port, payload, messages, rounds + 1))
    finally:
        if cpus:
            os.sched_setaffinity(0, cpus)
        receiver.join(30)
        if receiver.is_alive():
            receiver.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16, help="MiB per message (16)")
    parser.add_argument("--messages", type=int, default=4, help="messages per round (4)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (5)")
    parser.add_argument("--cases", nargs="*", default=CASES, choices=CASES)
    args = parser.parse_args()
    print(
        f"one-way loopback throughput, {args.size} MiB messages, {args.messages} per round, "
        f"median of {args.rounds} rounds; sender and receiver in separate processes"
        + (", each on its own CPU" if len(_cpus()) >= 2 else ", sharing one CPU")
    )
    print(f"{'transport':<38} {'median GB/s':>12} {'min':>8} {'max':>8}")
    for case in args.cases:
        rates = measure(case, args.size * MiB, args.messages, args.rounds)
        median = statistics.median(rates)
        print(f"{case:<38} {median:>12.3f} {min(rates):>8.3f} {max(rates):>8.3f}")


if __name__ == "__main__":
    main()
