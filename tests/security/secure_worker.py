"""One process of the security tests: a member node, a member that corrupts its connection,
or an intruder holding the wrong token.

Usage::

    python secure_worker.py member NODE NUM_NODES ORCH TRANSPORT TOKEN STOPFILE [CORRUPTION]
    python secure_worker.py intruder ORCH TRANSPORT TOKEN DATA_PORT

Members run one device each (peer id = node index) and loop over all-reduces whose results
they check exactly; every all-reduce also carries a stop flag (``STOPFILE`` exists), so the
nodes stop after the same operation. They print JSON lines on stdout::

    {"event": "ready", "node": n, "port": data_port}
    {"event": "injected", "node": n, "kind": kind, "at": wall_time}    (the corrupting member)
    {"event": "done", "node": n, "ok": bool, "iterations": k, "error": type, "message": str,
     "cause": type, "at": wall_time}

A member given ``CORRUPTION`` on node 1 sends one malformed message on its own (already
authenticated) connection to node 0 after its fifth all-reduce -- a test double inside this
process, reaching into the data service's internals.

The *schedule* kinds (:data:`SCHEDULE_KINDS`: a member that holds the token sends well-formed
frames off the operation's schedule) run a global ring all-reduce and then an 8 KB broadcast
from node 1 per iteration, both checked exactly against NumPy float64; after the fifth
iteration node 1 rewrites its next frames to node 0 (:func:`corrupt_schedule`). Their ``done``
record adds ``rss_base_mb`` (after the first iteration) and ``rss_peak_mb`` (the process's
peak), so a test can bound the memory the corruption cost. The intruder tries to register with the
orchestrator, and to authenticate with node 0's data service, and prints one record per try::

    {"event": "intruder", "target": "orchestrator" | "data", "error": type, "message": str,
     "elapsed": seconds}

Logging goes to stderr at WARNING (the test reads the reasons the nodes logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

import burncoll
from burncoll.protocol.wire import encode_control
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client
from burncoll.transport.websocket import WebSocketConnection
from tests.security.hostile import WS_BAD_FRAMING, WS_OVERSIZED_FROM_SERVER, malformed

#: Elements per all-reduce (400 kB of float64, so frames are not trivially small).
ELEMENTS = 50_000
#: Members stop on their own after this long, whatever the test does.
MAX_SECONDS = 60.0
#: The corrupting member corrupts after this many good all-reduces.
CORRUPT_AFTER = 5


#: Schedule kinds -> elements per all-reduce (overlap/out_of_order need chunks of two parts).
SCHEDULE_KINDS = {
    "overlap": 1_100_000,
    "out_of_order": 1_100_000,
    "huge_chunk_bytes": ELEMENTS,
    "huge_shape": ELEMENTS,
    "unexpected_key": ELEMENTS,
    "future_flood": ELEMENTS,
}
#: Elements of the broadcast of each schedule-kind iteration (8 KB of float64).
BROADCAST_ELEMENTS = 1000


def flood_bytes() -> int:
    """Bytes of frames of a far-future operation the ``future_flood`` member sends: more than
    the receiver may hold (the held budget plus its transport's receive queue) by 128 MiB,
    so that hoarding them all would show."""
    from burncoll.node.held import HELD_BYTES
    from burncoll.transport.stream import RECV_QUEUE_BYTES

    return HELD_BYTES + RECV_QUEUE_BYTES + (128 << 20)


#: Tasks started by a corruption (a reference keeps them running).
_TASKS: set[asyncio.Task[None]] = set()


def rss_mb() -> float:
    """This process's resident memory now, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0  # pragma: no cover - not Linux


def peak_rss_mb() -> float:
    """This process's peak resident memory, MiB: ``VmHWM``, which starts afresh at ``exec``
    (``getrusage``'s ``ru_maxrss`` does not: it keeps the forking parent's peak, here the
    test runner's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0  # pragma: no cover - not Linux


def corrupt_schedule(comm: burncoll.Communicator, kind: str) -> None:
    """Node 1 (a test double inside the process) rewrites its next DATA frames to node 0 as
    ``kind`` says; runs on the node's loop. Every frame stays well-formed: only the schedule
    is broken (parts overlapping or swapped, a huge ``chunk_bytes``, a shape of 8 TiB, a key
    the receiver does not expect), or ``future_flood`` sends :data:`FLOOD_BYTES` of frames of
    an operation a million ahead."""
    import dataclasses

    from burncoll.node.executor import PART_BYTES
    from burncoll.ops import OpKind
    from burncoll.protocol.wire import decode, encode_data_header
    from burncoll.strategies import Tree
    from burncoll.strategies.layout import even_layout

    link = _link(comm)  # (a test double: the node's internals)
    service = link._service
    real_send = service.send
    state: dict[str, Any] = {"done": False, "held": None}
    # the global broadcast's schedule under auto (choose hands the node Tree(2))
    num_chunks = Tree(2).broadcast(link.num_nodes, 1).num_chunks

    async def send(node: int, parts: Any) -> None:
        raw = b"".join(bytes(p) for p in parts)
        h = decode(raw).header
        if node != 0 or h is None or state["done"]:
            await real_send(node, parts)
            return
        size = len(raw) - len(encode_data_header(h, 0))
        payload = raw[len(raw) - size:]
        out: list[list[Any]] = [[raw]]
        if kind == "overlap" and h.offset == PART_BYTES:
            moved = dataclasses.replace(h, offset=PART_BYTES // 2)
            out, state["done"] = [[encode_data_header(moved, size), payload]], True
        elif kind == "out_of_order" and h.offset == 0 and h.chunk_bytes > PART_BYTES:
            state["held"], out = raw, []
        elif kind == "out_of_order" and state["held"] is not None:
            out, state["done"] = [[raw], [state["held"]]], True
        elif kind == "huge_chunk_bytes" and h.op_kind is OpKind.BROADCAST:
            bad = dataclasses.replace(h, chunk_bytes=1_400_000_000)
            out, state["done"] = [[encode_data_header(bad, size), payload]], True
        elif kind == "huge_shape" and h.op_kind is OpKind.BROADCAST:
            count = 1 << 40
            a, b = even_layout(count, num_chunks)[h.chunk]
            bad = dataclasses.replace(h, shape=(count,), chunk_bytes=(b - a) * 8)
            part = min(PART_BYTES, (b - a) * 8)
            out, state["done"] = [[encode_data_header(bad, part), bytes(part)]], True
        elif kind == "unexpected_key":
            bad = dataclasses.replace(h, round=h.round + 100)
            out, state["done"] = [[encode_data_header(bad, size), payload]], True
        for message in out:
            await real_send(node, message)

    if kind == "future_flood":
        async def flood() -> None:
            seq = service.mailbox.current + 1_000_000
            total = flood_bytes()
            zeros = bytes(PART_BYTES)
            first = decode(_flood_header()).header
            assert first is not None
            header = dataclasses.replace(first, session=service.session or 0, seq=seq, src=1,
                                         chunk_bytes=total, shape=(total // 8,))
            for offset in range(0, total, PART_BYTES):
                h = dataclasses.replace(header, offset=offset)
                await real_send(0, [encode_data_header(h, PART_BYTES), zeros])

        _TASKS.add(asyncio.get_running_loop().create_task(flood()))
        return
    service.send = send


def _flood_header() -> bytes:
    from burncoll.ops import OpKind, ReduceOp
    from burncoll.protocol.wire import DataHeader, encode_data_header

    return encode_data_header(DataHeader(
        session=0, seq=0, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM, dtype="float64",
        shape=(1,), root=-1, src=1, round=0, channel=0, chunk=0, offset=0, chunk_bytes=0), 0)


def schedule_member(node_i: int, nodes_i: int, cfg: burncoll.CollectiveConfig, stopfile: str,
                    kind: str) -> None:
    """A member of a schedule-kind run (see the module docstring)."""
    elements = SCHEDULE_KINDS[kind]
    record: dict[str, Any] = {"event": "done", "node": node_i}
    k = 0
    started = time.monotonic()
    comm: burncoll.Communicator | None = None
    try:
        comm = burncoll.register(node_i, 0, cfg)
        emit({"event": "ready", "node": node_i, "port": _link(comm)._service.port})
        while True:
            stop = os.path.exists(stopfile) or time.monotonic() - started > MAX_SECONDS
            x = np.full(elements + 1, float(node_i + 1) * (k + 1))
            x[-1] = 1.0 if stop else 0.0
            r = comm.all_reduce(x)
            want = np.sum(np.stack([np.full(elements, float(n + 1) * (k + 1), np.float64)
                                    for n in range(nodes_i)]), axis=0)
            if r.shape != x.shape or not np.array_equal(r[:-1], want):
                raise AssertionError(f"all-reduce {k} returned a wrong result: {r[:3]}...")
            mine = np.arange(BROADCAST_ELEMENTS, dtype=np.float64) * (k + 1)
            b = comm.broadcast(mine if node_i == 1 else None, root=1)
            if b.shape != mine.shape or b.dtype != mine.dtype or not np.array_equal(b, mine):
                raise AssertionError(f"broadcast {k} returned a wrong result: {b[:3]}...")
            k += 1
            if k == 1:
                record["rss_base_mb"] = rss_mb()
            if r[-1] > 0:
                break
            if node_i == 1 and k == CORRUPT_AFTER:
                _link(comm)._io.submit(_install(comm, kind)).result(5)
                emit({"event": "injected", "node": node_i, "kind": kind, "at": time.time()})
            time.sleep(0.005)
        record["ok"] = True
        comm.finish()
    except burncoll.CollectiveError as exc:
        cause = exc.__cause__
        record.update(ok=False, error=type(exc).__name__, message=str(exc),
                      cause=type(cause).__name__ if cause is not None else None)
    except AssertionError as exc:
        record.update(ok=False, error="AssertionError", message=str(exc))
    record.update(iterations=k, at=time.time(), rss_peak_mb=peak_rss_mb())
    emit(record)
    if comm is not None and not record.get("ok"):
        with contextlib.suppress(burncoll.CollectiveError):
            comm.finish()


async def _install(comm: burncoll.Communicator, kind: str) -> None:
    corrupt_schedule(comm, kind)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def expected_sum(num_nodes: int, k: int) -> float:
    return float(sum(n + 1 for n in range(num_nodes)) * (k + 1))


def _link(comm: burncoll.Communicator) -> Any:
    """The node's :class:`~burncoll.node.link.NodeLink` (internal: data service, I/O loop)."""
    return comm._server.link


async def corrupt(comm: burncoll.Communicator, kind: str) -> None:
    """Send one malformed message on this node's connection to node 0 (runs on the node's loop).

    ``oversized`` and ``stream`` corrupt below the burncoll frame: a transport message
    announced far over the size limit, and bytes that break the transport's own framing.
    """
    service = _link(comm)._service
    conn = service.connections.out[0]
    async with service.connections._locks[0]:
        if kind == "oversized":
            if isinstance(conn, WebSocketConnection):
                # this node is the server of the connection it sends on: frames go unmasked
                assert conn.transport is not None
                conn.transport.write(WS_OVERSIZED_FROM_SERVER)
            else:
                quic = conn._protocol._quic
                quic.send_stream_data(conn._stream_id, (1 << 40).to_bytes(8, "little"))
                conn._protocol.transmit()
        elif kind == "stream":
            if isinstance(conn, WebSocketConnection):
                assert conn.transport is not None
                conn.transport.write(WS_BAD_FRAMING)
            else:
                # A length prefix, then fewer bytes than it announced, then the stream's end.
                quic = conn._protocol._quic
                quic.send_stream_data(
                    conn._stream_id, (1000).to_bytes(8, "little") + b"x" * 10, end_stream=True
                )
                conn._protocol.transmit()
        else:
            await conn.send([malformed(kind, ELEMENTS)])


def member(argv: list[str]) -> None:
    node, num_nodes, orch, transport, token, stopfile = argv[:6]
    kind = argv[6] if len(argv) > 6 else ""
    node_i, nodes_i = int(node), int(num_nodes)
    timeout = float(os.environ.get("TEST_TIMEOUT", "10"))
    cfg = burncoll.CollectiveConfig(
        num_devices=1,
        num_nodes=nodes_i,
        global_address=orch,
        node_address="127.0.0.1",
        data_service_port=0,
        transport=transport,
        timeout=timeout,
        auth_token=token,
    )
    if kind in SCHEDULE_KINDS:
        schedule_member(node_i, nodes_i, cfg.replace(global_all_reduce_strategy="ring"),
                        stopfile, kind)
        return
    record: dict[str, Any] = {"event": "done", "node": node_i}
    k = 0
    started = time.monotonic()
    comm: burncoll.Communicator | None = None
    try:
        comm = burncoll.register(node_i, 0, cfg)
        emit({"event": "ready", "node": node_i, "port": _link(comm)._service.port})
        while True:
            stop = os.path.exists(stopfile) or time.monotonic() - started > MAX_SECONDS
            x = np.full(ELEMENTS + 1, float(node_i + 1) * (k + 1))
            x[-1] = 1.0 if stop else 0.0
            r = comm.all_reduce(x)
            want = expected_sum(nodes_i, k)
            if r.shape != x.shape or not np.all(r[:-1] == want) or r[-1] not in range(nodes_i + 1):
                raise AssertionError(f"all-reduce {k} returned a wrong result: {r[:3]}...")
            k += 1
            if r[-1] > 0:
                break
            if kind and node_i == 1 and k == CORRUPT_AFTER:
                _link(comm)._io.submit(corrupt(comm, kind)).result(5)
                emit({"event": "injected", "node": node_i, "kind": kind, "at": time.time()})
            time.sleep(0.005)
        record["ok"] = True
        comm.finish()
    except burncoll.CollectiveError as exc:
        cause = exc.__cause__
        record.update(
            ok=False,
            error=type(exc).__name__,
            message=str(exc),
            cause=type(cause).__name__ if cause is not None else None,
        )
    except AssertionError as exc:
        record.update(ok=False, error="AssertionError", message=str(exc))
    record.update(iterations=k, at=time.time())
    emit(record)
    if comm is not None and not record.get("ok"):
        # An aborted collective lets each peer leave at once; this closes its connections.
        with contextlib.suppress(burncoll.CollectiveError):
            comm.finish()


def intruder(argv: list[str]) -> None:
    orch, transport, token, data_port = argv[:4]
    cfg = burncoll.CollectiveConfig(
        num_devices=1,
        num_nodes=2,
        global_address=orch,
        node_address="127.0.0.1",
        data_service_port=0,
        transport=transport,
        timeout=10.0,
        auth_token=token,
    )
    started = time.monotonic()
    try:
        burncoll.register(7, 0, cfg)
        emit(
            {
                "event": "intruder",
                "target": "orchestrator",
                "error": None,
                "message": "",
                "elapsed": time.monotonic() - started,
            }
        )
    except burncoll.CollectiveError as exc:
        emit(
            {
                "event": "intruder",
                "target": "orchestrator",
                "error": type(exc).__name__,
                "message": str(exc),
                "elapsed": time.monotonic() - started,
            }
        )

    async def to_data_port() -> None:
        conn = await get_transport(transport).connect("127.0.0.1", int(data_port))
        try:
            await authenticate_client(conn, token, 10.0)
            # Past authentication (it must not get here): try to join as a node.
            await conn.send([encode_control({"type": "hello", "node": 0})])
        finally:
            await conn.close()

    started = time.monotonic()
    try:
        asyncio.run(to_data_port())
        emit(
            {
                "event": "intruder",
                "target": "data",
                "error": None,
                "message": "",
                "elapsed": time.monotonic() - started,
            }
        )
    except burncoll.CollectiveError as exc:
        emit(
            {
                "event": "intruder",
                "target": "data",
                "error": type(exc).__name__,
                "message": str(exc),
                "elapsed": time.monotonic() - started,
            }
        )


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )
    if sys.argv[1] == "member":
        member(sys.argv[2:])
    elif sys.argv[1] == "intruder":
        intruder(sys.argv[2:])
    else:
        raise SystemExit(f"unknown role {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
