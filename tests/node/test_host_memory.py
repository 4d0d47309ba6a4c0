"""Host memory among node processes of one host (:mod:`burncoll.node.host_memory`): the host
mail (:mod:`burncoll.node.host_mail`) and the host reduction (:mod:`burncoll.node.host_reduce`).

Real node processes through a real orchestrator (this file, run as a script, is one node):
many back-to-back small all-reduces of 8 B to 64 KiB through the mail (and 256 KiB, and 1 MiB
on the sockets, between 2 nodes), then, from 3 nodes, large ones through the host reduction
(arrays of several pieces with an uneven last one); every reduce op, several dtypes, fresh
results, ``out=`` and in place, barriers between them, each input new (a message read from a
slot too early or too late gives a wrong result), each result compared with NumPy in float64
and bitwise identical on every node. A node process that dies while the others wait in the
host memory is named by every survivor at once. Then nodes as threads of this process (one
host too): a node that cannot make its mapping, or cannot map the others', leaves every node
on the sockets from the first operation; a node that offers a file that is not a mapping (not
sealed), or another node's, fails the join on every node, named; a processor without ordered
stores keeps the exchange on the sockets; a node that never calls times the others out by
their deadline; different sizes are a mismatch; 2 nodes map the mail and a stream region
each; a session that only sends point to point holds no memory for the data slots; and nodes
of two devices share their sums through the mail and the host reduction. Last, the mail's
slot bound and the futex it sleeps on, between real threads.
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
import burncoll.local.plans.choose as choose_module
import burncoll.node.host_memory as host_memory_module
import burncoll.node.host_reduce as host_reduce_module
from burncoll.levels import Exchange, HostGather, HostReduce, Medium
from burncoll.node.host_mail import SLOT_BYTES, Futex, SharedMail
from burncoll.node.host_memory import host_memory_bytes, regions_at
from burncoll.strategies import Ring
from burncoll.transport.shm import RING_BYTES
from tests.harness import (
    all_reduce_as,
    reduced_float64,
    register_node_process,
    run_node_processes,
    run_nodes,
)

Call = tuple[str, int, str, str]
#: Each call: (dtype, elements, reduce op, how the result is asked for); ``barrier`` between.
CALLS: list[Call] = [
    ("float32", 2, "sum", "fresh"),  # 8 B
    ("int64", 1, "prod", "in place"),
    ("float64", 512, "max", "out"),  # 4 KiB
    ("float32", 16_384, "sum", "fresh"),  # 64 KiB
    ("int32", 1_000, "mean", "fresh"),  # (integers: a float64 mean)
    ("float64", 3, "min", "in place")]
#: Between 2 nodes also (exchanges of 2 nodes go up to 2 MiB): 256 KiB through the mail,
#: 1 MiB past its slots, on the caller sockets, in between.
BIG: list[Call] = [("float32", 1 << 16, "sum", "out"), ("float64", 1 << 17, "max", "fresh")]
ROUNDS = 8
#: From 3 nodes, after the rounds: the host reduction (pieces of 4 MiB in the node processes).
LARGE: list[Call] = [
    ("float32", 2_500_003, "sum", "fresh"),  # 10 MiB: 3 pieces, the last uneven
    ("float64", 300_001, "max", "out"),
    ("int64", 300_000, "prod", "in place"),
    ("float32", 1 << 20, "mean", "fresh"),
    ("float64", 400_000, "min", "fresh")]


def _input(node: int, i: int, call: Call) -> np.ndarray:
    dtype, n, op, _ = call
    rng = np.random.default_rng(7919 * i + node)
    if op == "prod":
        return rng.choice(np.array([-3, 1, 2], dtype), n)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _reference(nodes: int, i: int, call: Call) -> np.ndarray:
    return reduced_float64(np.stack([_input(n, i, call) for n in range(nodes)]), call[2])


def _call(comm: burncoll.Communicator, x: np.ndarray, call: Call) -> np.ndarray:
    return all_reduce_as(comm, x, call[2], call[3])


def _posted(comm: burncoll.Communicator) -> int:
    """Messages this node posted in the mail (0: no mail)."""
    mail = comm._server.link._lanes.mail  # type: ignore[attr-defined]
    return 0 if mail is None else int(mail.posted_count)


def _host_memory(comm: burncoll.Communicator) -> bool:
    """Whether the nodes agreed at join that they share host memory."""
    return bool(comm._server.link.host_memory)  # type: ignore[attr-defined]


def _routes(comm: burncoll.Communicator) -> list[Any]:
    """The routes of this node's plans so far, in the order first planned."""
    return [plan.route for plan in comm._server.plans.values()]  # type: ignore[attr-defined]


def _checked(record: dict[str, Any], digest: Any, comm: burncoll.Communicator, node: int,
             nodes: int, i: int, call: Call) -> None:
    got = _call(comm, _input(node, i, call), call)
    want = _reference(nodes, i, call)
    record["error"] = max(record["error"], float(np.max(
        np.abs(got.astype(np.float64) - want) / (1.0 + np.abs(want)))))
    digest.update(got.tobytes())
    record["calls"] += 1


#: Set in a node process's environment: its small all-reduces and barriers take the host
#: gather (``auto`` gives it to 16 node processes or more) and ``DIES`` exits in one of them.
GATHER = "BURNCOLL_TEST_GATHER"


def _node_main(argv: list[str]) -> None:
    """``NODE NODES ORCH_ADDRESS TRANSPORT DIES`` (``DIES``: the node that exits as the host
    reduction starts -- with :data:`GATHER`, in a gather --, or -1): print one JSON record."""
    host_reduce_module.PIECE_BYTES = 4 << 20  # (a slot holds 32 MiB: many pieces' rounds)
    gather = GATHER in os.environ
    if gather:
        choose_module.GATHER_NODES = 2
    comm, node, nodes, dies = register_node_process(argv)
    record: dict[str, Any] = {"node": node, "error": 0.0, "calls": 0}
    digest = hashlib.sha256()
    started = time.monotonic()
    try:
        for i in range(ROUNDS):
            for call in [*CALLS, *BIG] if nodes == 2 else CALLS:
                if gather and node == dies and i == ROUNDS // 2:
                    time.sleep(0.3)  # the others wait in the gather
                    os._exit(3)
                started = time.monotonic()
                _checked(record, digest, comm, node, nodes, i, call)
            comm.barrier()
        record["posted"] = _posted(comm)
        for i, call in enumerate(LARGE if nodes >= 3 else []):
            if node == dies:
                time.sleep(0.3)  # the others wait in the host memory
                os._exit(3)  # a process that dies: its sockets close with it
            started = time.monotonic()
            _checked(record, digest, comm, node, nodes, i, call)
        record["host_memory"] = _host_memory(comm)
        record["routes"] = [repr(r) for r in _routes(comm)]
        comm.finish()
    except burncoll.CollectiveError as exc:
        record["raised"] = f"{type(exc).__name__}: {exc}"
        record["seconds"] = time.monotonic() - started
    record["sha"] = digest.hexdigest()
    print(json.dumps(record), flush=True)


def _run_processes(nodes: int, transport: str, dies: int = -1, gather: bool = False,
                   monkeypatch: pytest.MonkeyPatch | None = None) -> list[dict[str, Any]]:
    if gather:
        assert monkeypatch is not None
        monkeypatch.setenv(GATHER, "1")
    return run_node_processes(__file__, nodes, transport, dies)


@pytest.mark.parametrize(("nodes", "transport", "gather"), [
    (2, "tcp", False), (3, "tcp", False), (4, "websocket", False), (3, "tcp", True),
    (4, "websocket", True)])
def test_node_processes_of_one_host_share_their_host_memory(
        nodes: int, transport: str, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _run_processes(nodes, transport, gather=gather, monkeypatch=monkeypatch)
    assert len(records) == nodes
    small = ROUNDS * (len(CALLS) + 2 * (nodes == 2))
    for record in records:
        assert "raised" not in record and record["host_memory"] is True, record
        assert record["calls"] == small + len(LARGE) * (nodes >= 3), record
        assert record["error"] <= 1e-5, record  # (float32 sums; every other call exact)
        # every small call and barrier posted once in the mail (a gather numbers two
        # messages: every node's and the root's result); between 2 nodes, the 1 MiB one is a
        # host reduction of one piece, its two rounds in the mail (the handshake's 2 rounds
        # at join go on the sockets and post nothing)
        assert record["posted"] == (small + ROUNDS) * (1 + gather) + ROUNDS * (nodes == 2), (
            record)
        assert "HostReduce()" in record["routes"], record
        assert ("HostGather()" in record["routes"]) is gather, record
    assert len({r["sha"] for r in records}) == 1  # the same bits on every node


@pytest.mark.parametrize(("dies", "gather"), [(2, False), (2, True), (0, True)],
                         ids=["host_reduction", "gather", "gather_root"])
def test_a_node_process_that_dies_is_named_by_every_survivor_at_once(
        dies: int, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _run_processes(3, "tcp", dies, gather, monkeypatch)
    assert len(records) == 2
    for record in records:
        calls = ROUNDS // 2 * len(CALLS) if gather else ROUNDS * len(CALLS)
        assert record["calls"] == calls, record
        assert record["raised"].startswith(("PeerLost", "CollectiveAborted")), record
        assert f"node {dies}" in record["raised"], record
        assert record["seconds"] < 20.0 / 2, record  # half the timeout: not at the deadline


# -- nodes as threads of this process -----------------------------------------------------

def _threads(nodes: int, fn: Any, timeout: float = 20.0, devices: int = 1,
             **config: Any) -> dict[int, Any]:
    with burncoll.start_orchestrator(transport="tcp") as orch:
        return run_nodes(orch.address, nodes, devices, fn, transport="tcp", timeout=timeout,
                         **config)


def _first_call_only(name: str, double: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace ``name`` (``new_host_file`` or ``map_offered``) in the host memory module with
    ``double`` for the first node that calls it (the nodes are threads of this process)."""
    real, lock, first_caller = getattr(host_memory_module, name), threading.Lock(), []

    def replaced(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if not first_caller:
                first_caller.append(threading.current_thread())
        if first_caller[0] is threading.current_thread():
            return double(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(host_memory_module, name, replaced)


def _calls(comm: burncoll.Communicator) -> tuple[list[np.ndarray], int, list[Any]]:
    """Every small call twice, a barrier, and (3 nodes) 2 large calls."""
    calls = CALLS * 2 + (LARGE[:2] if comm.world_size >= 3 else [])
    got = [_call(comm, _input(comm.rank, i, call), call) for i, call in enumerate(calls)]
    comm.barrier()
    return got, _posted(comm), _routes(comm)


def _check_calls(out: dict[int, Any], nodes: int, posted: int, *routes: Any) -> None:
    """Every node's results are right and the same, it posted ``posted`` messages, and its
    plans took ``routes``."""
    calls = CALLS * 2 + (LARGE[:2] if nodes >= 3 else [])
    for rank in range(nodes):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, count, taken = out[rank]
        assert count == posted, count
        assert set(taken) == set(routes), taken
        for i, call in enumerate(calls):
            np.testing.assert_allclose(got[i], _reference(nodes, i, call), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[i], out[0][0][i])


def _no_memory(token: str, size: int, **kwargs: Any) -> tuple[int, memoryview]:
    raise OSError(12, "Cannot allocate memory (a test double)")


def _declined(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.mark.parametrize(("name", "double"), [("new_host_file", _no_memory),
                                              ("map_offered", _declined)])
@pytest.mark.parametrize("nodes", [2, 3])
def test_a_node_without_host_memory_leaves_every_node_on_the_sockets(
        name: str, double: Any, nodes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One node cannot make its mapping, or cannot map the others' (``/proc`` closed to it:
    ``map_offered`` declines; only its answer says so, and every node reads every answer):
    the session forms, every node without host memory and with the same routes -- the lanes
    and (3 nodes: the exchange stops at 256 KiB) the ring -- from the first operation."""
    _first_call_only(name, double, monkeypatch)
    routes = [Exchange(Medium.LANE), *([Ring()] if nodes >= 3 else [])]
    _check_calls(_threads(nodes, _calls), nodes, 0, *routes)


def test_a_processor_without_ordered_stores_keeps_the_exchange_on_the_sockets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host memory is set up (3 nodes: for the host reduction), without its mail: the
    exchanges take the lanes from the first operation, and the host reduction's rounds too."""
    monkeypatch.setattr(host_memory_module, "ORDERED_STORES", False)
    _check_calls(_threads(3, _calls), 3, 0, Exchange(Medium.LANE), HostReduce())


@pytest.mark.parametrize("gather", [False, True], ids=["exchange", "gather"])
def test_the_host_memory_carries_the_calls_of_thread_nodes_too(
        gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 large calls of 3 pieces of 32 MiB and less: 2 rounds each in the mail. With the
    gather, each small call and the barrier number two messages."""
    if gather:
        monkeypatch.setattr(choose_module, "GATHER_NODES", 3)
    _check_calls(_threads(3, _calls), 3, (2 * len(CALLS) + 1) * (1 + gather) + 2 * 2,
                 HostGather() if gather else Exchange(Medium.HOST), HostReduce())


def test_auto_gathers_from_16_node_processes_of_one_host() -> None:
    from burncoll.strategies.auto import GATHER_NODES
    assert choose_module.GATHER_NODES == GATHER_NODES == 16


def test_a_node_offering_a_file_that_is_not_sealed_is_named_by_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unsealed(token: str, size: int, **kwargs: Any) -> tuple[int, memoryview]:
        fd = os.memfd_create(f"burncoll-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)  # ... and no seals: it could shrink under a reader's mapping
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == 0
        return fd, memoryview(mmap.mmap(fd, size))

    _first_call_only("new_host_file", unsealed, monkeypatch)
    out = _threads(3, lambda comm: comm.all_reduce(np.ones(4)))
    named = set()
    for rank in range(3):
        error = out[rank]
        assert isinstance(error, burncoll.CollectiveError), error
        if "could still be resized" in str(error):
            named.add(str(error).split("node ")[1].split()[0])
    assert len(named) == 1, out  # every node that checked it names the same node


def test_a_node_offering_another_nodes_mapping_as_its_own_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second node to make its mapping offers the first one's file instead (the same
    token, a duplicate descriptor of it): a file offered twice fails the session."""
    made: list[tuple[int, memoryview]] = []
    lock = threading.Lock()
    real = host_memory_module.new_host_file

    def new_host_file(token: str, size: int, **kwargs: Any) -> tuple[int, memoryview]:
        with lock:
            if made:
                return os.dup(made[0][0]), made[0][1]
            made.append(real(token, size, **kwargs))
            return made[0]

    monkeypatch.setattr(host_memory_module, "new_host_file", new_host_file)
    monkeypatch.setattr(host_memory_module.secrets, "token_hex", lambda n: "ab" * n)
    out = _threads(3, lambda comm: comm.all_reduce(np.ones(4)))
    assert all(isinstance(out[r], burncoll.CollectiveError) for r in range(3)), out
    assert any("offered too" in str(out[r]) for r in range(3)), out


#: The small calls' routes in the tests below: the exchange in the mail, or the gather.
ROUTES = pytest.mark.parametrize("gather", [False, True], ids=["exchange", "gather"])


def _gathering(gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if gather:
        monkeypatch.setattr(choose_module, "GATHER_NODES", 2)


@ROUTES
@pytest.mark.parametrize("elements", [2, 40_000])  # the mail; the host reduction
def test_a_node_that_never_calls_times_out_the_others(
        elements: int, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the gather, node 2 waits for the root's result, and names node 1 (which has not
    posted), not the root."""
    _gathering(gather, monkeypatch)

    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        if comm.rank == 1:
            time.sleep(4.0)
            return None
        started = time.monotonic()
        try:
            comm.all_reduce(np.ones(elements))
        except burncoll.CollectiveTimeout as exc:
            return exc, time.monotonic() - started
        raise AssertionError("the all-reduce returned without node 1")

    timeout = 1.5
    out = _threads(3, fn, timeout=timeout)
    for rank in (0, 2):
        error, waited = out[rank]
        assert "node 1" in str(error) or "[1]" in str(error), error
        assert timeout - 0.5 <= waited < 3 * timeout, waited  # at its deadline, not never


@ROUTES
@pytest.mark.parametrize("odd", [0, 2], ids=["root", "other"])
@pytest.mark.parametrize("elements", [100, 600_000])  # the mail; the host reduction
def test_different_sizes_are_a_mismatch_on_every_node(
        elements: int, odd: int, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _gathering(gather, monkeypatch)

    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        return comm.all_reduce(np.ones(elements + elements // 10 * (comm.rank == odd),
                                       np.float32))

    out = _threads(3, fn)
    for rank in range(3):
        assert isinstance(out[rank], burncoll.MismatchError), out[rank]
        assert str(elements) in str(out[rank]), out[rank]
        assert str(elements + elements // 10) in str(out[rank]), out[rank]


@ROUTES
@pytest.mark.parametrize("barrier", [0, 1], ids=["root", "other"])
def test_a_barrier_against_an_all_reduce_is_a_mismatch_on_every_node(
        barrier: int, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The barrier's message is shorter than the other call's header: the report reads that
    header whole (not "a malformed message")."""
    _gathering(gather, monkeypatch)

    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        if comm.rank == barrier:
            return comm.barrier()
        return comm.all_reduce(np.ones(2, np.float32))

    out = _threads(2, fn)
    for rank in range(2):
        assert isinstance(out[rank], burncoll.MismatchError), out[rank]
        assert "barrier" in str(out[rank]) and "all_reduce" in str(out[rank]), out[rank]


def test_two_nodes_map_the_mail_the_data_slot_and_a_stream_region_each() -> None:
    """Between 2 nodes a mapping is the mail, the host reduction's data slot and result area,
    and one stream region to the other node, handed to its connection at join."""
    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        link = comm._server.link  # type: ignore[attr-defined]
        connections = link._service.connections
        return (sorted(len(m) for m in link._host_memory.maps.values()),
                [c._region is not None for c in connections.out.values()],
                [c._region is not None for c in connections.dialed.values()])

    out = _threads(2, fn)
    for rank in range(2):
        assert out[rank] == ([host_memory_bytes(2)] * 2, [True], [True]), out[rank]
    assert host_memory_bytes(2) == regions_at(2) + RING_BYTES
    assert regions_at(2) == regions_at(3) > host_memory_module.PIECE_BYTES  # (none touched)


def test_nodes_of_two_hosts_share_stream_regions_within_each_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """4 nodes as 2 hosts of 2 (a host identity per pair, given as each registers): the
    session has no host memory of its own (not one host), but each node's connections to and
    from the other node of its host take their stream regions, the large parts between them
    go through them, and every result is exact."""
    import burncoll.node.joining as joining_module

    registered, lock = [], threading.Lock()

    def two_hosts() -> str:
        with lock:
            registered.append(None)
            return ("a" if len(registered) <= 2 else "b") * 32

    monkeypatch.setattr(joining_module, "host_identity", two_hosts)
    call = LARGE[1]

    def fn(comm: burncoll.Communicator) -> Any:
        got = _call(comm, _input(comm.rank, 0, call), call)
        link = comm._server.link  # type: ignore[attr-defined]
        conns = link._service.connections
        sending = {n: c._position for n, c in conns.out.items() if getattr(c, "_region", None)}
        receiving = [n for n, c in conns.dialed.items() if getattr(c, "_region", None)]
        return got, (link.host_memory, link.host_mail), link.hosts, sending, receiving

    out = _threads(4, fn)
    for rank in range(4):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, capabilities, hosts, sending, receiving = out[rank]
        assert capabilities == (False, False) and sorted(hosts) == [0, 0, 1, 1], out[rank]
        peer = [n for n in range(4) if n != rank and hosts[n] == hosts[rank]]
        assert sorted(sending) == receiving == peer, out[rank]
        np.testing.assert_allclose(got, _reference(4, 0, call), rtol=1e-12)
    assert any(position for r in range(4) for position in out[r][3].values())


def _resident_kib() -> int:
    """Resident memory of every host file mapped in this process (each node's mappings), from
    ``/proc/self/smaps``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = "memfd:burncoll-" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_host_memory_made_at_join_holds_memory_only_once_used() -> None:
    """The host memory is set up at join whatever the session does: one that only sends point
    to point (and meets at barriers, through the mail) holds no memory for its data slots;
    a 16 MiB all-reduce through them then does (4 MiB of slot per node, mapped by 3)."""
    before = _resident_kib()

    def fn(comm: burncoll.Communicator) -> Any:
        if comm.rank == 0:
            comm.send(np.arange(1000, dtype=np.float32), 1)
        elif comm.rank == 1:
            got = comm.recv(0)
            assert np.array_equal(got, np.arange(1000, dtype=np.float32))
        comm.barrier()
        idle = _resident_kib() - before if comm.rank == 0 else None
        comm.barrier()
        x = np.full(4 << 20, comm.rank + 1, np.float32)  # 16 MiB
        result = comm.all_reduce(x)
        comm.barrier()
        used = _resident_kib() - before if comm.rank == 0 else None
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
def test_nodes_of_two_devices_share_their_sums_through_the_host_memory(local: str) -> None:
    """Each node reduces its 2 devices' arrays (inline under ``auto`` up to 1 MiB, a local
    schedule past it or with a local ring), and shares the node's sum: small ones through the
    mail, large ones through the host reduction (channel 0: with a local ring, shard 0 there
    and shard 1 on the ring)."""
    sizes = (3, 16_000, 200_001, 700_000)  # 12 B, 64 KB, 800 KB and 2.8 MB of float32
    xs = {(r, n): np.random.default_rng(10 * r + n).standard_normal(n).astype(np.float32)
          for r in range(6) for n in sizes}

    def fn(comm: burncoll.Communicator) -> Any:
        got = [comm.all_reduce(xs[comm.rank, n]) for n in sizes]
        return got, _host_memory(comm)

    out = _threads(3, fn, devices=2, local_all_reduce_strategy=local)
    for rank in range(6):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, used = out[rank]
        assert used is True
        for i, n in enumerate(sizes):
            want = sum(xs[r, n].astype(np.float64) for r in range(6))
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[i], out[0][0][i])


def test_a_message_larger_than_a_slot_is_refused_and_never_posted() -> None:
    """``choose`` sends through the mail only what fits a slot; a message past it (a wrong
    route) would write into the other slot, which another node may still read: refused,
    and the counter stays."""
    maps = {n: memoryview(mmap.mmap(-1, 2 << 20)) for n in (0, 1)}
    mail, reader = SharedMail(maps, 0, 0), SharedMail(maps, 1, 0)
    header = b"h" * 64
    with pytest.raises(ValueError, match="larger than a slot"):
        mail.post((header, bytes(SLOT_BYTES - len(header) + 1)))
    assert mail.posted_count == 0 and not reader.posted(0, 1)
    assert mail.post((header, bytes(SLOT_BYTES - len(header)))) == 1 and reader.posted(0, 1)


# -- the futex the mail sleeps on ------------------------------------------------------------

def test_a_sleeper_on_a_counter_is_woken_by_its_writer_and_never_misses_a_change() -> None:
    """Real threads on a real shared mapping: a changed counter does not sleep at all, a
    sleeper is woken by the writer's wake long before its timeout, and with no wake it
    sleeps until the timeout."""
    mapping = mmap.mmap(-1, 4096)
    counter = np.frombuffer(mapping, np.uint64, 1)
    address = int(counter.ctypes.data)
    futex = Futex()

    started = time.monotonic()
    futex.wait(address, 7, 5.0)  # the counter is 0, not 7: no sleep
    assert time.monotonic() - started < 5.0 / 2

    def write_then_wake() -> None:
        time.sleep(0.2)
        counter[0] = 1
        futex.wake(address)

    writer = threading.Thread(target=write_then_wake)
    started = time.monotonic()
    writer.start()
    while counter[0] == 0 and time.monotonic() - started < 10:
        futex.wait(address, 0, 5.0)
    woken = time.monotonic() - started
    writer.join()
    assert counter[0] == 1 and 0.15 <= woken < 2.5, woken  # (not the 5 s timeout)

    started = time.monotonic()
    futex.wait(address, 1, 0.3)  # nobody wakes it
    assert 0.25 <= time.monotonic() - started < 3.0


# -- a post wakes only a sleeper: no wake-up is lost ---------------------------------------

_NAP = 60.0  # a reader's longest sleep here: far longer than any test waits for it


class _PostsFirst(Futex):
    """The futex of a reader that, between its look at the counter and its sleep, lets a
    poster post (``post``): forces that interleaving."""

    def __init__(self, post: Any) -> None:
        super().__init__()
        self.post = post

    def wait(self, address: int, value: int, seconds: float) -> None:
        self.post()
        super().wait(address, value, seconds)


def _pair() -> tuple[SharedMail, SharedMail]:
    maps = {n: memoryview(mmap.mmap(-1, 2 << 20)) for n in (0, 1)}
    return SharedMail(maps, 0, 0), SharedMail(maps, 1, 0)


@pytest.mark.parametrize("poster_saw", ["no sleeper", "the sleeper"])
def test_a_post_between_a_readers_look_and_its_sleep_is_never_missed(poster_saw: str) -> None:
    """The race the sleeping word must not lose: the reader has looked at the counter (not
    posted yet), the poster posts before the reader sleeps -- having read the reader's word
    before the reader wrote it (no wake: the poster skips the system call) or after it (a
    wake with nobody asleep yet). Either way the reader, sleeping on the counter it saw, must
    return at once: the kernel compares the counter first."""
    poster, reader = _pair()

    def post() -> None:
        if poster_saw == "no sleeper":  # (as if read before the reader's store)
            word, reader._counters[1][1] = int(reader._counters[1][1]), 0
            poster.post((b"m" * 64,))
            reader._counters[1][1] = word
        else:
            assert int(reader._counters[1][1]) == 1  # (the reader names node 0 already)
            poster.post((b"m" * 64,))

    reader._futex = _PostsFirst(post)
    started = time.monotonic()
    reader.sleep(0, 1, _NAP)
    assert time.monotonic() - started < _NAP / 2 and reader.posted(0, 1)
    assert int(reader._counters[1][1]) == 0  # (awake again: the word is cleared)


def test_a_post_wakes_a_reader_asleep_on_its_counter() -> None:
    """A reader asleep on node 0's counter (real threads, a real shared mapping) is woken by
    node 0's post long before its sleep would end; a reader that is not asleep is not named."""
    poster, reader = _pair()
    assert int(poster._counters[1][1]) == 0
    done: list[float] = []

    def sleep() -> None:
        started = time.monotonic()
        reader.sleep(0, 1, _NAP)
        done.append(time.monotonic() - started)

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    started = time.monotonic()
    while int(poster._counters[1][1]) != 1 and time.monotonic() - started < _NAP / 2:
        time.sleep(0.001)  # until the reader names node 0 (then it is asleep, or about to be)
    poster.post((b"m" * 64,))
    sleeper.join(_NAP / 2)
    assert not sleeper.is_alive() and done and done[0] < _NAP / 2
    assert int(poster._counters[1][1]) == 0


if __name__ == "__main__":
    _node_main(sys.argv[1:])
