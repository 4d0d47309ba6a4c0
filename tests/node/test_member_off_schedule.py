"""A member that holds the token and sends well-formed frames off the schedule (issue 11).

Two member processes around a real orchestrator (``tests/security/cluster.py``) loop over a
global ring all-reduce and an 8 KB broadcast from node 1, checked exactly against NumPy
float64. After five iterations node 1 (a test double inside its process:
``secure_worker.corrupt_schedule``) rewrites its next frames to node 0: two parts that
overlap, two parts swapped, a broadcast part claiming a 1.3 GB chunk, a broadcast of an 8 TiB
shape, a key node 0 does not receive. Every node must fail at once with a ProtocolError that
says what was wrong and names node 1, no node may return a wrong result, and node 0's memory
must stay bounded. A flood of frames of a far-future operation must not be hoarded: node 0
holds at most its budget (the session then stalls: that member blocks its own connection).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from burncoll.node.held import HELD_BYTES
from burncoll.transport.stream import RECV_QUEUE_BYTES
from tests.security.cluster import Cluster
from tests.security.secure_worker import CORRUPT_AFTER

#: The members' operation timeout; every node must fail well before it.
TIMEOUT = 10.0
#: Most seconds from the corruption to each node's error: half the timeout, so that no node
#: waited for its deadline (which would take the timeout), with room for a loaded machine.
QUICK = TIMEOUT / 2
#: Most node 0 may grow (peak resident memory over the one after the first iteration) when
#: the corruption is refused: no buffer is allocated on the corrupted header's word.
GROWTH_MB = 200.0

#: Kind -> what every node's error must say.
WHY = {
    "overlap": "overlapping a part already received",
    "out_of_order": "out of order",
    "huge_chunk_bytes": "announcing a chunk of 1400000000 bytes where this node expects",
    "huge_shape": "more than this machine's memory",
    "unexpected_key": "does not receive in that operation",
}
CASES = [*(("websocket", kind) for kind in WHY),
         ("quic", "out_of_order"), ("quic", "huge_chunk_bytes")]


@functools.cache
def run(transport: str, kind: str, timeout: float = TIMEOUT) -> tuple[float, list[dict[str, Any]]]:
    with Cluster(transport, timeout=timeout, corruption=kind) as cluster:
        done = cluster.wait_for("done", 2, timeout * 4)
        injected = cluster.of("injected")
        assert len(injected) == 1, cluster.events
        cluster.finish(timeout * 2)
        return float(injected[0]["at"]), sorted(done, key=lambda r: int(r["node"]))


@pytest.fixture(autouse=True)
def _nodes_talk_over_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hostile member's frames travel on the network between nodes: keep this host's
    nodes there rather than on shared memory (``burncoll.transport.shm``)."""
    monkeypatch.setenv("BURNCOLL_SHARED_MEMORY", "0")


def _root(record: dict[str, Any]) -> str:
    return str(record["cause"] if record["error"] == "CollectiveAborted" else record["error"])


@pytest.mark.parametrize(("transport", "kind"), CASES)
def test_a_member_off_the_schedule_fails_every_node_with_a_protocol_error(
    transport: str, kind: str
) -> None:
    injected_at, done = run(transport, kind)
    for record in done:
        # every result before was exact (a wrong one ends the loop with AssertionError)
        assert record["error"] not in (None, "AssertionError"), record
        assert _root(record) == "ProtocolError", record
        assert WHY[kind] in record["message"], record
        assert "node 1" in record["message"], record
        # (node 1, a broadcast's root, may finish it -- it only sends -- and fail in the next)
        assert CORRUPT_AFTER - 1 <= record["iterations"] <= CORRUPT_AFTER + 1, record
        assert record["at"] - injected_at < QUICK, record
    growth = done[0]["rss_peak_mb"] - done[0]["rss_base_mb"]
    assert growth < GROWTH_MB, (growth, done[0])


def test_a_flood_of_frames_for_a_future_operation_is_not_hoarded() -> None:
    """Node 1 sends the budget plus the transport's receive queue plus 128 MiB of frames of an
    operation a million ahead: node 0 stops reading that connection once it holds its budget
    (64 MiB), so it never holds them all. The member blocked its own connection: the
    collective then fails (a timeout), with no wrong result."""
    _, done = run("websocket", "future_flood", 5.0)
    for record in done:
        assert record["error"] != "AssertionError", record
        assert record.get("ok") or record["error"] is not None, record
    bound_mb = (HELD_BYTES + RECV_QUEUE_BYTES) / 2**20 + 96
    growth = done[0]["rss_peak_mb"] - done[0]["rss_base_mb"]
    assert growth < bound_mb, (growth, bound_mb, done[0])
