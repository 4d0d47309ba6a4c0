"""All-reduces through shared segments among node processes of one host
(:mod:`burncoll.node.segments`).

Real node processes through a real orchestrator (this file, run as a script, is one node):
every reduce op and dtype, arrays of several pieces with an uneven last one, fresh results,
``out=`` and in place, each result compared with NumPy in float64 and bitwise identical on
every node; the segments were used; and a node process that dies in the middle of the
session is reported by every survivor, naming it. Then nodes as threads of this process (one
host too): a node that cannot make its segment at join (a test double) leaves every node on
the ring from the first operation, with correct results; so does a node that cannot map the
others' (the set-up's answers disagree on one node only: every node still chooses the same
route); a node that offers a file that is not a segment (not sealed) fails the session at
join on every node, named, and so does one that offers another node's segment as its own;
a node that never calls times out the others by their deadline;
different sizes are a mismatch; a session that only sends point to point holds no memory for
the segments' data slots; and nodes of two devices share their reduction through the
segments (with a local ring, shard 0 there and shard 1 on the ring).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.segments as segments_module
from burncoll.levels import HostReduce
from burncoll.strategies import Ring
from tests.harness import (
    all_reduce_as,
    reduced_float64,
    register_node_process,
    run_node_processes,
    run_nodes,
)

#: Each call: (dtype, elements, reduce op, how the result is asked for).
CALLS = [("float32", 2_500_003, "sum", "fresh"),  # 10 MiB: 3 pieces (below), the last uneven
         ("float64", 300_001, "max", "out"),
         ("int64", 300_000, "prod", "in place"),
         ("float32", 1 << 20, "mean", "fresh"),
         ("float64", 400_000, "min", "fresh")]


def _input(node: int, call: int) -> np.ndarray:
    dtype, n, op, _ = CALLS[call]
    rng = np.random.default_rng(1000 * call + node)
    if op == "prod":
        return rng.choice(np.array([-1, 1, 2], dtype), n)
    return rng.standard_normal(n).astype(dtype)


def _reference(nodes: int, call: int) -> np.ndarray:
    return reduced_float64(np.stack([_input(n, call) for n in range(nodes)]), CALLS[call][2])


def _segments_used(comm: burncoll.Communicator) -> bool:
    """Whether the nodes agreed at join that they share host memory."""
    return bool(comm._server.link.host_memory)  # type: ignore[attr-defined]


def _routes(comm: burncoll.Communicator) -> list[Any]:
    """The routes of this node's plans so far, in the order first planned."""
    return [plan.route for plan in comm._server.plans.values()]  # type: ignore[attr-defined]


def _call(comm: burncoll.Communicator, node: int, call: int) -> np.ndarray:
    return all_reduce_as(comm, _input(node, call), CALLS[call][2], CALLS[call][3])


def _node_main(argv: list[str]) -> None:
    """``NODE NODES ORCH_ADDRESS TRANSPORT DIES`` (``DIES``: the node that exits after the
    first call, or -1): print one JSON record."""
    # Pieces of 4 MiB (a slot holds PIECE_BYTES): a few MiB test the rounds of many pieces.
    segments_module.PIECE_BYTES = 4 << 20
    comm, node, nodes, dies = register_node_process(argv)
    record: dict[str, Any] = {"node": node, "results": []}
    try:
        for call in range(len(CALLS)):
            if call == 1 and node == dies:
                os._exit(3)  # a process that dies: its sockets close with it
            got = _call(comm, node, call)
            record["results"].append({
                "sha": hashlib.sha256(got.tobytes()).hexdigest(),
                "error": float(np.max(np.abs(got.astype(np.float64) - _reference(nodes, call))
                                      / (1.0 + np.abs(_reference(nodes, call)))))})
            record["segments"] = _segments_used(comm)
        comm.finish()
    except burncoll.CollectiveError as exc:
        record["raised"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(record), flush=True)


def _run_processes(nodes: int, transport: str, dies: int = -1) -> list[dict[str, Any]]:
    return run_node_processes(__file__, nodes, transport, dies)


@pytest.mark.parametrize(("nodes", "transport"), [(3, "tcp"), (4, "websocket")])
def test_node_processes_of_one_host_all_reduce_through_their_segments(
        nodes: int, transport: str) -> None:
    records = _run_processes(nodes, transport)
    assert len(records) == nodes
    for record in records:
        assert "raised" not in record, record
        assert record["segments"] is True, record
        for call, result in enumerate(record["results"]):
            tolerance = 1e-5 if CALLS[call][0] == "float32" else 1e-12
            assert result["error"] <= tolerance, (call, result)
    for call in range(len(CALLS)):  # the same bits on every node
        assert len({r["results"][call]["sha"] for r in records}) == 1, call


def test_a_node_process_that_dies_is_named_by_every_survivor() -> None:
    records = _run_processes(3, "tcp", dies=2)
    assert len(records) == 2
    for record in records:
        assert len(record["results"]) == 1, record
        assert record["raised"].startswith(("PeerLost", "CollectiveAborted")), record
        assert "node 2" in record["raised"], record


# -- nodes as threads of this process -----------------------------------------------------

def _threads(nodes: int, fn: Any, timeout: float = 20.0, devices: int = 1,
             **config: Any) -> dict[int, Any]:
    with burncoll.start_orchestrator(transport="tcp") as orch:
        return run_nodes(orch.address, nodes, devices, fn, transport="tcp", timeout=timeout,
                         **config)


def _first_call_only(name: str, double: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace ``name`` (``new_ring`` or ``map_offered``) in the segments module with
    ``double`` for the first node that calls it (the nodes are threads of this process)."""
    real, lock, first_caller = getattr(segments_module, name), threading.Lock(), []

    def replaced(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if not first_caller:
                first_caller.append(threading.current_thread())
        if first_caller[0] is threading.current_thread():
            return double(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(segments_module, name, replaced)


def _on_the_ring_from_the_first_operation(out: dict[int, Any]) -> None:
    """Every node: no host memory, the ring for both calls (3 nodes of one host: the
    exchange stops at 256 KiB), the same routes, results right and the same."""
    for rank in range(3):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, used, routes = out[rank]
        assert used is False
        assert routes == [Ring(), Ring()], routes
        for call, result in zip((0, 1), got, strict=True):
            np.testing.assert_allclose(result, _reference(3, call), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(result, out[0][0][call])


def _two_calls(comm: burncoll.Communicator) -> Any:
    return [_call(comm, comm.rank, call) for call in (0, 1)], _segments_used(comm), _routes(
        comm)


def test_a_node_without_its_segment_leaves_every_node_on_the_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(token: str, size: int, **kwargs: Any) -> tuple[int, mmap.mmap]:
        raise OSError(12, "Cannot allocate memory (a test double)")

    _first_call_only("new_ring", no_memory, monkeypatch)
    _on_the_ring_from_the_first_operation(_threads(3, _two_calls))


def test_a_node_that_cannot_map_the_others_leaves_every_node_on_the_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The set-up fails on one node only: it made and offered its segment, as every node
    did, but cannot map the others' (``/proc`` closed to it: ``map_offered`` declines). Only
    its answer says so, and every node reads every answer: the session forms, every node
    without host memory and with the same routes."""
    def declined(*args: Any, **kwargs: Any) -> None:
        return None

    _first_call_only("map_offered", declined, monkeypatch)
    _on_the_ring_from_the_first_operation(_threads(3, _two_calls))


def test_a_node_offering_a_file_that_is_not_a_segment_is_named_by_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unsealed(token: str, size: int, **kwargs: Any) -> tuple[int, mmap.mmap]:
        fd = os.memfd_create(f"burncoll-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)  # ... and no seals: it could shrink under a reader's mapping
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == 0
        return fd, mmap.mmap(fd, size)

    _first_call_only("new_ring", unsealed, monkeypatch)
    out = _threads(3, lambda comm: _call(comm, comm.rank, 0))
    named = set()
    for rank in range(3):
        error = out[rank]
        assert isinstance(error, burncoll.CollectiveError), error
        if "could still be resized" in str(error):
            named.add(str(error).split("node ")[1].split()[0])
    assert len(named) == 1, out  # every node that checked it names the same node


def test_a_node_offering_another_nodes_segment_as_its_own_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second node to make its segment offers the first one's file instead (the same
    token, a duplicate descriptor of it): a file offered twice fails the session."""
    made: list[tuple[int, mmap.mmap]] = []
    lock = threading.Lock()
    real = segments_module.new_ring

    def new_ring(token: str, size: int, **kwargs: Any) -> tuple[int, mmap.mmap]:
        with lock:
            if made:
                return os.dup(made[0][0]), made[0][1]
            made.append(real(token, size, **kwargs))
            return made[0]

    monkeypatch.setattr(segments_module, "new_ring", new_ring)
    monkeypatch.setattr(segments_module.secrets, "token_hex", lambda n: "ab" * n)
    out = _threads(3, lambda comm: _call(comm, comm.rank, 0))
    assert all(isinstance(out[r], burncoll.CollectiveError) for r in range(3)), out
    assert any("offered too" in str(out[r]) for r in range(3)), out


def test_a_node_that_never_calls_times_out_the_others() -> None:
    def fn(comm: burncoll.Communicator) -> Any:
        if comm.rank == 2:
            time.sleep(5.0)
            return None
        started = time.monotonic()
        try:
            _call(comm, comm.rank, 0)
        except burncoll.CollectiveTimeout as exc:
            return exc, time.monotonic() - started
        raise AssertionError("the all-reduce returned without node 2")

    out = _threads(3, fn, timeout=2.0)
    for rank in (0, 1):
        error, waited = out[rank]
        assert "node 2" in str(error) or "[2]" in str(error), error
        assert waited < 2.0 + 3.0, waited


def test_different_sizes_are_a_mismatch() -> None:
    def fn(comm: burncoll.Communicator) -> Any:
        return comm.all_reduce(np.ones(600_000 + 1000 * (comm.rank == 1), np.float32))

    out = _threads(3, fn)
    for rank in range(3):
        assert isinstance(out[rank], burncoll.MismatchError), out[rank]
        assert "600000" in str(out[rank]) and "601000" in str(out[rank]), out[rank]


def _segments_resident_kib() -> int:
    """Resident memory of every segment mapped in this process (each node's mappings), from
    ``/proc/self/smaps``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = "memfd:burncoll-" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_segments_made_at_join_hold_memory_only_once_used() -> None:
    """The segments are set up at join whatever the session does: one that only sends point
    to point (and meets at barriers, through the mail) holds no memory for their data slots;
    a 16 MiB all-reduce through them then does (4 MiB of slot per node, mapped by 3)."""
    before = _segments_resident_kib()

    def fn(comm: burncoll.Communicator) -> Any:
        if comm.rank == 0:
            comm.send(np.arange(1000, dtype=np.float32), 1)
        elif comm.rank == 1:
            got = comm.recv(0)
            assert np.array_equal(got, np.arange(1000, dtype=np.float32))
        comm.barrier()
        idle = _segments_resident_kib() - before if comm.rank == 0 else None
        comm.barrier()
        x = np.full(4 << 20, comm.rank + 1, np.float32)  # 16 MiB
        result = comm.all_reduce(x)
        comm.barrier()
        used = _segments_resident_kib() - before if comm.rank == 0 else None
        comm.barrier()
        return idle, used, bool(np.all(result == 6)), _routes(comm)

    out = _threads(3, fn)
    for rank in range(3):
        assert not isinstance(out[rank], BaseException), out[rank]
        assert out[rank][2], rank
    idle, used, _, routes = out[0]
    assert HostReduce() in routes, routes
    assert idle < 4 << 10, idle  # KiB: the mail's pages in use, not 3 x 3 x 48 MiB
    assert used > 3 * (16 << 10), used  # (16 MiB of slots and results, seen by 3 mappings)


@pytest.mark.parametrize("local", ["auto", "ring"])
def test_nodes_of_several_devices_share_their_reduction_through_the_segments(
        local: str) -> None:
    """Under ``auto`` a node reduces its devices first (inline up to 1 MiB, then a local
    schedule) and shares the node's sum; with a local ring, shard 0 goes through the
    segments (channel 0) and shard 1 on the ring."""
    sizes = (200_001, 700_000)  # 800 KiB and 2.8 MiB of float32 per peer
    xs = {(r, n): np.random.default_rng(10 * r + n).standard_normal(n).astype(np.float32)
          for r in range(6) for n in sizes}

    def fn(comm: burncoll.Communicator) -> Any:
        return [comm.all_reduce(xs[comm.rank, n]) for n in sizes], _segments_used(comm)

    out = _threads(3, fn, devices=2, local_all_reduce_strategy=local)
    for rank in range(6):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, used = out[rank]
        assert used is True
        for i, n in enumerate(sizes):
            want = sum(xs[r, n].astype(np.float64) for r in range(6))
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[i], out[0][0][i])


if __name__ == "__main__":
    _node_main(sys.argv[1:])
