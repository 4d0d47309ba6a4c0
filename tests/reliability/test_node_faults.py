"""Fault injection across real node processes: every operation completes or raises on every
peer within its deadline, with a message that names what happened and who is to blame.

Each test starts real node processes (``worker.py``, public API only) around a real
orchestrator on 127.0.0.1, over WebSocket and QUIC, and injects one fault: a node SIGKILLed
mid-operation, a node alive but stuck, the orchestrator killed or not yet up, a port already
taken, a node restarted, a frame dropped, delayed or doubled on its way. Over QUIC (UDP) a
killed node sends nothing more, so survivors may only learn of it when their deadline passes:
they raise :class:`~burncoll.CollectiveTimeout` naming it rather than
:class:`~burncoll.PeerLost`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

import burncoll
from tests.reliability.cluster import Cluster, OrchestratorProcess, free_port, orchestrator
from tests.reliability.conftest import FaultTable

T = TypeVar("T")
TRANSPORTS = ["websocket", "quic"]
#: Survivors must raise within the timeout plus this (status queries, barrier grace, load).
SLACK = 3.0
#: (local strategy, global strategy, every kind of operation rather than only all_reduce)
STRATEGY_PAIRS = [
    ("tree", "ring", False),
    ("ring", "centralized", False),
    ("centralized", "tree", False),
    ("tree:3", "tree:3", True),
]


def run_concurrently(*fns: Callable[[threading.Barrier], T]) -> list[T]:
    """Run independent scenarios side by side (they mostly wait); re-raise the first error.

    Each scenario gets the same gate for its :class:`Cluster`: no cluster registers before
    every cluster's processes have started Python, so that a short registration deadline
    does not run out while the other clusters are still importing on the same two cores."""
    results: list[Any] = [None] * len(fns)
    gate = threading.Barrier(len(fns))

    def one(i: int) -> None:
        try:
            results[i] = fns[i](gate)
        except BaseException as exc:
            gate.abort()
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def by_peer(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(r["peer"]): r for r in records}


def summary(records: list[dict[str, Any]]) -> list[str]:
    """What each peer's record says, short enough for an assertion message."""
    return [
        f"peer {r['peer']}: {r.get('stage', 'ops')} {r.get('error')}: {r.get('message')}"
        for r in records
    ]


def first_error(record: dict[str, Any]) -> str:
    """The error a peer's failing call stands for: a failure that came in between two calls
    makes the next call raise CollectiveAborted at once, with the failure as its cause."""
    if record["error"] == "CollectiveAborted":
        return str(record["cause"])
    return str(record["error"])


def seconds(values: list[float], timeout: float | None = None) -> str:
    """The worst of ``values`` for the table, against the timeout when there is one."""
    if not values:
        return "-"
    worst = max(values)
    text = f"{worst:.2f} s" if worst < 1 else f"{worst:.1f} s"
    return text + ("" if timeout is None else f" (timeout {timeout:g} s)")


# -- a node killed ---------------------------------------------------------------------------


def _kill_run(
    transport: str, local: str, global_: str, mix: bool, timeout: float, gate: threading.Barrier
) -> tuple[list[dict[str, Any]], float]:
    with (
        orchestrator(transport) as address,
        Cluster(
            address,
            3,
            2,
            transport=transport,
            timeout=timeout,
            local=local,
            global_=global_,
            scenario="kill",
            gate=gate,
            victim=1,
            at=5,
            count=10_000,
            size=20_000,
            mix=mix,
        ) as cluster,
    ):
        records = cluster.collect()
        kill = cluster.procs[1].event("kill")
    assert kill is not None, f"the victim was not killed: {summary(records)}"
    return records, float(kill["t"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_node_makes_every_survivor_raise_naming_it(
    transport: str, fault_table: FaultTable
) -> None:
    timeout = 4.0
    runs = run_concurrently(
        *(
            (lambda gate, p=pair: _kill_run(transport, p[0], p[1], p[2], timeout, gate))
            for pair in STRATEGY_PAIRS
        )
    )
    expected = ("PeerLost",) if transport == "websocket" else ("PeerLost", "CollectiveTimeout")
    delays: list[float] = []
    for (records, killed_at), pair in zip(runs, STRATEGY_PAIRS, strict=True):
        survivors = [r for r in records if r["node"] != 1]
        assert len(survivors) == 4, (pair, records)
        for r in survivors:
            assert first_error(r) in expected, (pair, r)
            assert "node 1 (peers [2, 3]" in r["message"], (pair, r)
            assert r["elapsed"] < timeout + SLACK, (pair, r)
            # afterwards: aborted at once, and leaving does not hang
            assert r["then"] == "CollectiveAborted" and r["then_s"] < timeout / 2, (pair, r)
            assert r["finish_s"] < timeout + SLACK, (pair, r)
            delays.append(r["t"] - killed_at)
    fault_table.add(
        "node SIGKILLed mid-operation (4 strategy pairs)",
        transport,
        "yes: 16/16 survivors raised " + "/".join(expected),
        seconds(delays, timeout),
    )


def test_a_node_killed_in_a_host_reduction_is_named_by_every_survivor(
    fault_table: FaultTable
) -> None:
    """Host memory on: 3 node processes of this host all-reduce 320 KB of float64 each
    through their host memory (``HostReduce``), and node 1 is SIGKILLed in the middle of
    one: every survivor raises ``PeerLost`` naming it by its deadline, with right results
    before, and no survivor crashes (its mapping of node 1's host memory stays valid)."""
    timeout = 4.0
    with orchestrator("tcp") as address, Cluster(
            address, 3, 1, transport="tcp", timeout=timeout, local="auto", global_="auto",
            scenario="kill", victim=1, at=5, count=10_000, size=40_000,
            host_memory=True) as cluster:
        records = cluster.collect()
        kill = cluster.procs[1].event("kill")
    assert kill is not None, f"the victim was not killed: {summary(records)}"
    survivors = [r for r in records if r["node"] != 1]
    assert len(survivors) == 2, records
    for r in survivors:
        assert r["segments_mapped"] == 3, r  # (its own and the 2 others': HostReduce's)
        assert r["op"] >= 5 and first_error(r) == "PeerLost", r  # (no WRONG result before)
        assert "node 1 (peers [1]" in r["message"], r
        assert r["elapsed"] < timeout + SLACK, r
        assert r["finish_s"] < timeout + SLACK, r
    fault_table.add("node SIGKILLed mid host reduction (shared memory)", "tcp",
                    "yes: 2/2 survivors raised PeerLost",
                    seconds([r["t"] - float(kill["t"]) for r in survivors], timeout))


# -- a node alive but stuck ------------------------------------------------------------------


def _stuck_run(
    transport: str, stuck: list[int], timeout: float, gate: threading.Barrier
) -> list[dict[str, Any]]:
    with (
        orchestrator(transport) as address,
        Cluster(
            address,
            3,
            2,
            transport=transport,
            timeout=timeout,
            scenario="stuck",
            gate=gate,
            victim=1,
            at=3,
            stuck=stuck,
            stuck_s=timeout + 2.5,
            count=6,
            size=100,
        ) as cluster,
    ):
        return cluster.collect()


def test_stuck_peer_or_node_times_out_naming_who_never_called(fault_table: FaultTable) -> None:
    """One local peer of node 1 never calls (WebSocket); all of node 1 never calls (QUIC)."""
    timeout = 2.0
    one_peer, whole_node = run_concurrently(
        lambda gate: _stuck_run("websocket", [0], timeout, gate),
        lambda gate: _stuck_run("quic", [0, 1], timeout, gate),
    )
    for records, missing, transport in ((one_peer, [2], "websocket"), (whole_node, [2, 3], "quic")):
        peers = by_peer(records)
        waited = []
        for pid, r in peers.items():
            if pid in missing:
                # it comes back late: the collective was aborted meanwhile
                assert r.get("stuck") and r["then"] == "CollectiveAborted", r
                continue
            assert first_error(r) == "CollectiveTimeout", r
            message = r["message"]
            assert "all_reduce #3 timed out after" in message, r
            # who never came: by peer id, or (when it was already gone when asked) by node
            assert (
                "never called it; arrived: peer 3" in message
                or f"never called all_reduce #3: {missing}" in message
                or "node 1 (peers [2, 3]) did not answer" in message
            ), r
            assert timeout - 0.1 < r["elapsed"] < timeout + SLACK, r
            waited.append(r["elapsed"])
        # the message separates the peers that never came from those that came and waited
        separated = (
            f"never called all_reduce #3: {missing}; peers that called it but did not finish",
            "local peer(s) [2] never called it; arrived: peer 3",
        )
        assert any(s in r.get("message", "") for r in records for s in separated), records
        what = "a local peer never calls" if missing == [2] else "a whole node never calls"
        fault_table.add(
            f"{what} (alive, stuck)",
            transport,
            f"yes: {len(waited)}/{len(waited)} others raised CollectiveTimeout",
            seconds(waited, timeout),
        )


# -- the orchestrator ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_orchestrator_killed_after_rendezvous(transport: str, fault_table: FaultTable) -> None:
    """Operations go on (the orchestrator is not on the data path); finish and a new register
    fail with an error naming it."""
    timeout = 2.0
    with OrchestratorProcess(transport) as orch:
        orch.wait_listening()
        with Cluster(
            orch.address,
            3,
            2,
            transport=transport,
            timeout=timeout,
            scenario="orch_kill",
            size=1000,
        ) as cluster:
            for p in cluster.procs:
                p.wait_event("registered", 30)
            orch.kill()
            for p in cluster.procs:
                p.send("go")
            records = cluster.collect()
    assert len(records) == 6
    for r in records:
        assert r["ops"] == "ok", r  # 12 operations of every kind, each checked
        assert r["register_again"] == "TransportError", r
        assert f"orchestrator at {orch.address}" in r["register_again_message"], r
        assert r["register_again_s"] < timeout + SLACK, r
    # one peer per node leaves the collective for the node, and learns the orchestrator is gone
    closers = [r for r in records if r["finish"] != "ok"]
    assert {r["node"] for r in closers} == {0, 1, 2}, records
    for r in closers:
        assert r["finish"] == "TransportError" and "orchestrator" in r["finish_message"], r
        assert r["finish_s"] < timeout + SLACK, r
    fault_table.add(
        "orchestrator SIGKILLed after rendezvous",
        transport,
        "yes: 12 operations of every kind went on; finish and register raised TransportError",
        f"finish {seconds([r['finish_s'] for r in closers])}, "
        f"register {seconds([r['register_again_s'] for r in records])}",
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_orchestrator_not_up_yet(transport: str, fault_table: FaultTable) -> None:
    """Nodes retry with backoff; the orchestrator comes up 1 s later, within the timeout.

    (It starts in this process: a child's interpreter start would take much of the nodes'
    5 s on a loaded machine; killing an orchestrator process is tested above.)"""
    port = free_port()
    with Cluster(
        f"127.0.0.1:{port}",
        2,
        2,
        transport=transport,
        timeout=5.0,
        scenario="ops",
        count=6,
        size=100,
    ) as cluster:
        time.sleep(1.0)
        with burncoll.start_orchestrator(port=port, transport=transport):
            records = cluster.collect()
    assert len(records) == 4
    for r in records:
        assert r["ok"], r
    fault_table.add(
        "orchestrator started 1 s after the nodes",
        transport,
        "yes: registered after retries, 6 operations correct",
        f"(registered in {seconds([r['register_s'] for r in records])})",
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_orchestrator_never_up(transport: str, fault_table: FaultTable) -> None:
    port = free_port()
    timeout = 1.5
    config = burncoll.CollectiveConfig(
        num_devices=1,
        num_nodes=2,
        global_address=f"127.0.0.1:{port}",
        node_address="127.0.0.1",
        transport=transport,
        timeout=timeout,
    )
    started = time.monotonic()
    with pytest.raises(burncoll.TransportError) as info:
        burncoll.register(0, 0, config)
    elapsed = time.monotonic() - started
    assert timeout - 0.1 < elapsed < timeout + SLACK
    message = str(info.value)
    assert f"could not reach the orchestrator at 127.0.0.1:{port} within 1.5 s" in message
    assert f"burncoll orchestrator --port {port}" in message
    fault_table.add(
        "no orchestrator at all",
        transport,
        "yes: register raised TransportError",
        f"{elapsed:.1f} s (timeout {timeout:g} s)",
    )


# -- ports ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_port_in_use_is_an_error_at_register_naming_it(
    transport: str, fault_table: FaultTable
) -> None:
    kind = socket.SOCK_STREAM if transport == "websocket" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as taken:
        taken.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            taken.listen()
        port = int(taken.getsockname()[1])
        with burncoll.start_orchestrator(transport=transport) as orch:
            config = burncoll.CollectiveConfig(
                num_devices=1,
                num_nodes=2,
                global_address=orch.address,
                node_address="127.0.0.1",
                data_service_port=port,
                transport=transport,
                timeout=5.0,
            )
            started = time.monotonic()
            with pytest.raises(burncoll.TransportError, match=f"127.0.0.1:{port}") as info:
                burncoll.register(0, 0, config)
            elapsed = time.monotonic() - started
            assert "port is in use" in str(info.value) and "data_service_port" in str(info.value)
            assert elapsed < config.timeout / 2  # at once, not by the timeout
        with pytest.raises(burncoll.TransportError, match=f"127.0.0.1:{port}.*in use"):
            burncoll.start_orchestrator(port=port, transport=transport)
    fault_table.add(
        "data service / orchestrator port already in use",
        transport,
        "yes: TransportError naming the port",
        f"{elapsed:.2f} s",
    )


# -- starting over ----------------------------------------------------------------------------


@pytest.mark.parametrize(("transport", "nodes", "rounds"), [("websocket", 3, 2), ("quic", 2, 1)])
def test_register_again_after_an_abort_in_the_same_processes(
    transport: str, nodes: int, rounds: int, fault_table: FaultTable
) -> None:
    """A mismatch aborts the collective everywhere; every peer registers again (no finish)
    and every kind of operation works; the aborted node's I/O thread is gone."""
    with (
        orchestrator(transport) as address,
        Cluster(
            address,
            nodes,
            2,
            transport=transport,
            timeout=3.0,
            scenario="reregister",
            size=50,
            rounds=rounds,
        ) as cluster,
    ):
        records = cluster.collect()
        exits = [p.event("exit") for p in cluster.procs]
    assert len(records) == 2 * nodes
    for r in records:
        for k in range(rounds):
            assert r[f"mismatch_{k}"] == "MismatchError", r
            assert r[f"after_{k}"] == "CollectiveAborted", r
            assert r[f"io_threads_{k}"] == 1, r
        assert r["ok"], r
    assert all(e is not None and e["io_threads"] == 0 for e in exits), exits
    fault_table.add(
        f"abort, then register again in the same processes (x{rounds})",
        transport,
        "yes: every operation correct afterwards",
        f"(registered again in {seconds([r['register_again_0_s'] for r in records])})",
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_node_rejoins_on_the_same_ports(transport: str, fault_table: FaultTable) -> None:
    """Node 1 is SIGKILLed; a new process takes its place (same data-service port) while the
    survivors register again in their own processes; every operation works."""
    ports = [free_port() for _ in range(3)]
    with (
        orchestrator(transport) as address,
        Cluster(
            address,
            3,
            2,
            transport=transport,
            timeout=2.5,
            scenario="restart",
            victim=1,
            at=4,
            count=10_000,
            size=500,
            ports=ports,
        ) as cluster,
    ):
        cluster.procs[1].wait_event("kill", 30)
        cluster.procs[1].wait(10)
        # restarted once the survivors know (as a supervisor watching them would)
        for survivor in (cluster.procs[0], cluster.procs[2]):
            survivor.wait_event("failed", 30)
        started = time.monotonic()
        cluster.replace(1, generation=1)
        records = cluster.collect()
        back = time.monotonic() - started
    peers = by_peer(records)
    assert sorted(peers) == list(range(6))
    for r in peers.values():
        assert r["ok"], (r.get("stage"), r.get("error"), r.get("message"), r)
        if r["node"] != 1:
            assert r["first_error"] in ("PeerLost", "CollectiveTimeout"), r
    fault_table.add(
        "node SIGKILLed, restarted; survivors register again",
        transport,
        "yes: every operation correct afterwards",
        f"(working again {back:.1f} s after the restart)",
    )


# -- frames dropped, delayed, doubled, cut ------------------------------------------------------

FRAME_FAULTS: list[dict[str, Any]] = [
    {"mode": "delay", "nth": 5, "delay": 0.5},
    {"mode": "drop", "nth": 5},
    {"mode": "duplicate", "nth": 1},  # a part of the first, big, operation
    {"mode": "close", "nth": 9},
]


def _frames_run(
    transport: str, fault: dict[str, Any], timeout: float, gate: threading.Barrier
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    with (
        orchestrator(transport) as address,
        Cluster(
            address,
            3,
            2,
            transport=transport,
            timeout=timeout,
            scenario="frames",
            gate=gate,
            victim=1,
            frames=fault,
            count=12,
            size=300,
            mix=True,
            big=1_700_000 if fault["mode"] == "duplicate" else 300,
        ) as cluster,
    ):
        records = cluster.collect()
        return records, cluster.procs[1].event("faults")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_frame_delayed_dropped_doubled_or_cut_never_gives_a_wrong_result(
    transport: str, fault_table: FaultTable
) -> None:
    """Node 1's connections tamper with one outgoing DATA frame (a test double around the real
    transport). Every peer either gets every result right, or raises a CollectiveError."""
    timeout = 3.0
    runs = run_concurrently(
        *(
            (lambda gate, fault=fault: _frames_run(transport, fault, timeout, gate))
            for fault in FRAME_FAULTS
        )
    )
    for (records, faults), fault in zip(runs, FRAME_FAULTS, strict=True):
        assert faults is not None and faults["injected"], (fault, faults, summary(records))
        assert len(records) == 6, (fault, records)
        for r in records:
            assert r.get("error") not in ("WRONG", "CRASH"), (fault, r)
        mode = fault["mode"]
        if mode == "delay":
            assert all(r["ok"] for r in records), (fault, records)
            fault_table.add("one frame delayed 0.5 s", transport, "yes: every result correct", "-")
            continue
        expected = {
            "drop": ("CollectiveTimeout",),
            "duplicate": ("ProtocolError",),
            "close": ("PeerLost", "CollectiveTimeout"),
        }[mode]
        for r in records:
            assert not r.get("ok") and first_error(r) in expected, (fault, r)
            assert r["elapsed"] < timeout + SLACK, (fault, r)
        if mode == "duplicate":
            assert all("twice" in r["message"] for r in records), records
        what = {
            "drop": "one frame dropped",
            "duplicate": "one frame sent twice",
            "close": "a connection closed mid-operation",
        }[mode]
        fault_table.add(
            what,
            transport,
            f"yes: 6/6 peers raised {'/'.join(expected)}, no wrong result",
            seconds([r["elapsed"] for r in records], timeout),
        )
