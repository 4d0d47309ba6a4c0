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
process, reaching into the data service's internals. The intruder tries to register with the
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
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client
from burncoll.transport.websocket import WebSocketConnection
from burncoll.transport.wire import encode_control
from tests.security.hostile import WS_BAD_FRAMING, WS_OVERSIZED_FROM_SERVER, malformed

#: Elements per all-reduce (400 kB of float64, so frames are not trivially small).
ELEMENTS = 50_000
#: Members stop on their own after this long, whatever the test does.
MAX_SECONDS = 60.0
#: The corrupting member corrupts after this many good all-reduces.
CORRUPT_AFTER = 5


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
    conn = service._out[0]
    async with service._send_locks[0]:
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
