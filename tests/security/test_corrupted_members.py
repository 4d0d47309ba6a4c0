"""A corrupted connection between members fails the operation on every peer with a clear
error: never a hang, never a wrong result (issue 4).

Two member processes loop over checked all-reduces; after five, node 1 sends one malformed
message on its own, already authenticated, connection to node 0 (a test double inside the
worker: ``secure_worker.corrupt``). Kinds: malformed burncoll frames (garbage, a wrong wire
version, an unknown operation, a truncated frame, invalid JSON) and corruption below them (a
transport message announced far over the size limit; bytes that break the WebSocket framing,
or a QUIC stream that ends in the middle of a message).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest

from tests import shared

from .cluster import Cluster
from .secure_worker import CORRUPT_AFTER

#: The members' operation timeout; every peer must fail well before it.
TIMEOUT = 10.0
#: Most seconds from the corruption to each peer's error: half the timeout, so that no peer
#: waited for its deadline, with room for a loaded machine.
QUICK = TIMEOUT / 2

#: Corruption kind -> what the error must say (any one of the phrases, for the stream kinds:
#: the wording of a broken WebSocket stream is the transport's own).
FRAME_KINDS = {
    "garbage": "bad magic",
    "version": "wire version 99 is not supported",
    "unknown_op": "unknown operation code 250",
    "truncated": "header announces",
    "bad_json": "not valid JSON",
}
STREAM_KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "websocket": {
        "oversized": ("exceeds the size limit",),
        "stream": ("invalid opcode", "reserved bits", "protocol error"),
    },
    # the sender may learn of it first from the receiver's stream reset: "over its size limit"
    "quic": {"oversized": ("exceeds the limit", "over its size limit"),
             "stream": ("in the middle of a message",)},
}
#: Node 1, which ended its own QUIC stream in the middle of a message (the test double), may
#: learn of the failure first by sending on that stream again: QUIC refuses data after a FIN.
OWN_STREAM_ENDED = "Cannot send data after FIN"
#: Frames are decoded the same way whatever carried them: QUIC runs a subset of them.
CASES: list[tuple[str, str]] = [
    *(("websocket", kind) for kind in [*FRAME_KINDS, *STREAM_KINDS["websocket"]]),
    *(("quic", kind) for kind in ["garbage", "unknown_op", *STREAM_KINDS["quic"]]),
]


@dataclass(frozen=True)
class CorruptRun:
    injected_at: float
    done: list[dict[str, Any]]
    node_log: str


@functools.cache
def corrupt_run(transport: str, kind: str) -> CorruptRun:
    """The run with ``kind`` of corruption: once per session (tests/shared.py)."""
    return shared.once(f"corrupt-{transport}-{kind}", lambda: _corrupt_run(transport, kind))


def _corrupt_run(transport: str, kind: str) -> CorruptRun:
    with Cluster(transport, timeout=TIMEOUT, corruption=kind) as cluster:
        done = cluster.wait_for("done", 2, TIMEOUT * 3)
        injected = cluster.of("injected")
        assert len(injected) == 1, cluster.events
        cluster.finish()
        return CorruptRun(
            float(injected[0]["at"]), sorted(done, key=lambda r: r["node"]), cluster.node_logs(0)
        )


def _says_why(text: str, transport: str, kind: str) -> bool:
    """Whether ``text`` gives the reason for corruption ``kind``."""
    if kind in FRAME_KINDS:
        return FRAME_KINDS[kind] in text
    return any(phrase in text for phrase in STREAM_KINDS[transport][kind])


@pytest.mark.parametrize(("transport", "kind"), CASES)
def test_a_corrupted_member_connection_fails_every_peer_quickly(transport: str, kind: str) -> None:
    run = corrupt_run(transport, kind)
    for record in run.done:
        # Every result was right (a wrong one ends the loop with AssertionError), and none
        # failed before the corruption. How many come after it depends on the scheduler:
        # the small all-reduces travel on the lanes (caller sockets), not on the corrupted
        # member connection, so each peer completes right results from intact data until
        # its node's reader of that connection fails the session -- within QUICK (below).
        assert record["error"] not in (None, "AssertionError"), record
        assert record["iterations"] >= CORRUPT_AFTER - 1, record
        # The error says what was wrong and names a node of the broken connection.
        own_end = (transport, kind, record["node"]) == ("quic", "stream", 1) and (
            OWN_STREAM_ENDED in record["message"])
        assert _says_why(record["message"], transport, kind) or own_end, record
        assert "node 0" in record["message"] or "node 1" in record["message"], record
        # Raised at once, not by the operation's timeout.
        assert record["at"] - run.injected_at < QUICK, record
    # node 0 received the bad bytes: its error blames node 1. (node 1 hears of them from node
    # 0's abort, or -- after a transport-level corruption -- finds its connection to node 0
    # closed by node 0, whichever comes first.)
    assert "node 1" in run.done[0]["message"], run.done[0]


#: A QUIC stream that ends in the middle of a message is reported as PeerLost, not
#: ProtocolError: the stream's end reaches the data service as a closed connection. (A broken
#: WebSocket stream is a ProtocolError: the framing says why, and a close frame tells the sender.)
_STREAM_AS_PEER_LOST = pytest.mark.xfail(
    reason="a QUIC stream cut mid-message between members is reported as PeerLost "
    "('its process may have died'), not as ProtocolError",
    strict=True,
)


@pytest.mark.parametrize(
    ("transport", "kind"),
    [
        pytest.param(t, k, marks=[_STREAM_AS_PEER_LOST] if (t, k) == ("quic", "stream") else [])
        for t, k in CASES
    ],
)
def test_a_malformed_frame_is_reported_as_a_protocol_error(transport: str, kind: str) -> None:
    for record in corrupt_run(transport, kind).done:
        root = record["cause"] if record["error"] == "CollectiveAborted" else record["error"]
        assert root == "ProtocolError", record
        assert "the connection between members is corrupted" in record["message"], record


@pytest.mark.parametrize(("transport", "kind"), CASES)
def test_the_receiving_node_logs_why_it_dropped_a_member_connection(
    transport: str, kind: str
) -> None:
    run = corrupt_run(transport, kind)
    assert _says_why(run.node_log, transport, kind), run.node_log
