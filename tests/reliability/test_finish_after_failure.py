"""``finish()`` on a node whose own calls all succeeded, while another node's call fails the
session: the finishing node learns of the failure (the other node's abort) and raises it at
once, instead of waiting for the orchestrator's confirmation until its deadline.

Node 1 is a broadcast's root (it only sends, so its call returns) and then finishes; node 0
calls an all-reduce in the broadcast's place and finds the mismatch when node 1's frame
arrives. (Node 1 may find it first, in its broadcast, where node 0's exchange goes on caller
sockets or through shared mail that it looks at.) Real nodes as threads of this process,
through a real orchestrator, per transport.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll


def _two_nodes(transport: str, body: Callable[[int, burncoll.Communicator, np.ndarray], None]
               ) -> None:
    """``body(rank, comm, x)`` on nodes 0 and 1, threads of this process, at a real
    orchestrator; both must end within 60 s."""
    with burncoll.start_orchestrator(transport=transport) as orch:

        def node(rank: int) -> None:
            cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=rank, num_devices=1,
                                            global_address=orch.address, transport=transport,
                                            timeout=20.0)
            body(rank, burncoll.register(rank, 0, cfg), np.arange(4, dtype=np.float32))

        threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("transport", ["tcp", "websocket", "quic"])
def test_finish_raises_the_failure_of_the_session_at_once(transport: str) -> None:
    out: dict[Any, Any] = {}

    def node(rank: int, comm: burncoll.Communicator, x: np.ndarray) -> None:
        if rank == 1:
            started = time.monotonic()
            try:
                out["broadcast"] = comm.broadcast(x, root=1)
                comm.finish()
                out[1] = "finished"
            except burncoll.CollectiveError as exc:
                out[1] = exc
            out["seconds"] = time.monotonic() - started
            return
        try:
            out[0] = comm.all_reduce(x)
        except burncoll.CollectiveError as exc:
            out[0] = exc
        finally:
            with contextlib.suppress(burncoll.CollectiveError):  # (its own error says why)
                comm.finish()

    _two_nodes(transport, node)
    assert isinstance(out[0], burncoll.MismatchError), out
    # node 1's broadcast returned (or found the mismatch itself, looking at the caller sockets
    # or the shared mail where node 0's exchange went), and finish() said what failed
    if "broadcast" in out:
        np.testing.assert_array_equal(out["broadcast"], np.arange(4, dtype=np.float32))
    # (over QUIC node 0's message may reach node 1 after its broadcast ended: a frame of a
    # finished operation, which it reports as such, naming node 0)
    assert isinstance(out[1], burncoll.CollectiveError), out
    assert "node 0" in str(out[1]) and "orchestrator" not in str(out[1]), out
    assert out["seconds"] < 10, out  # (the deadline is 20 s away)


@pytest.mark.parametrize("transport", ["tcp", "quic"])
def test_finish_raises_a_failure_that_came_after_the_nodes_last_call(transport: str) -> None:
    """Node 1's broadcast returns; node 0 then fails the session (its all-reduce meets the
    broadcast), and only after that does node 1 call finish(): the failure is already in, and
    finish() raises it, naming node 0. Node 0, whose own call raised it, finishes quietly."""
    out: dict[Any, Any] = {}
    failed = threading.Event()

    def node(rank: int, comm: burncoll.Communicator, x: np.ndarray) -> None:
        try:
            if rank == 1:
                out["broadcast"] = comm.broadcast(x, root=1)
                failed.wait(30)
                time.sleep(0.5)  # (node 0's abort arrives meanwhile)
            else:
                try:
                    out["all_reduce"] = comm.all_reduce(x)
                finally:
                    failed.set()
        except burncoll.CollectiveError as exc:
            out[("call", rank)] = exc
        try:
            comm.finish()
            out[("finish", rank)] = "finished"
        except burncoll.CollectiveError as exc:
            out[("finish", rank)] = exc

    _two_nodes(transport, node)
    assert isinstance(out[("call", 0)], burncoll.MismatchError), out
    assert out[("finish", 0)] == "finished", out
    if ("call", 1) not in out:  # (its broadcast returned: finish() says what failed)
        np.testing.assert_array_equal(out["broadcast"], np.arange(4, dtype=np.float32))
        assert isinstance(out[("finish", 1)], burncoll.CollectiveError), out
        assert "node 0" in str(out[("finish", 1)]), out
