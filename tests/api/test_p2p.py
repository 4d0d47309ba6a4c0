"""Point-to-point messages: ``send``, ``recv``, ``isend``, ``irecv`` (issue #14 item 1).

Real peers: 1-4 threads of one node (through the post office), and 2-3 nodes as threads of
this process over WebSocket and QUIC (DATA frames between nodes, mixed with hops between the
threads of a node). Every peer runs the same exchange: a ring of isend/irecv over many dtypes
and shapes (0-d and empty included), the order of messages per tag with tags interleaved, an
array of several parts, ``out=`` that matches and one that does not (MismatchError on both
sides, after which the collective goes on), and a blocking send while an asynchronous
collective waits in the queue (point-to-point never waits behind it). Each received array is
compared with the sent one, built again independently. A recv from a peer that never sends,
or a send to one that never receives, ends with a CollectiveTimeout naming the peer and tag on
every peer; misuse is a UsageError at once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.errors import CollectiveAborted, CollectiveTimeout, MismatchError, UsageError
from burncoll.node.mailbox import PART_BYTES
from tests.harness import run_nodes, run_peers

DTYPES = ["bool", "int8", "uint16", "int64", "float16", "float32", "complex64", "complex128"]
SHAPES: list[tuple[int, ...]] = [(), (0,), (3, 0), (7,), (2, 3, 4)]
CASES = [(d, s) for d in DTYPES for s in SHAPES]
#: More than one part between nodes.
BIG = PART_BYTES // 8 + 1001


def _pid(rank: int) -> int:
    """Peer ids are not ranks: rank ``r`` is peer ``7 + 5 r``."""
    return 7 + 5 * rank


def _message(src: int, dst: int, k: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Message ``k`` from rank ``src`` to rank ``dst``: random values over the dtype."""
    rng = np.random.default_rng([src, dst, k])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dt,
                                       endpoint=True))
    values = rng.standard_normal(shape) * 100
    if dt.kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    return np.asarray(values.astype(dt))


def _same(got: Any, want: np.ndarray, what: object) -> None:
    host = np.asarray(got)
    assert (host.dtype, host.shape) == (want.dtype, want.shape), (what, host.dtype, host.shape)
    np.testing.assert_array_equal(host, want, err_msg=str(what))


# -- the exchange every peer runs ---------------------------------------------------------------
def _exchange(comm: burncoll.Communicator) -> dict[str, Any]:
    n, r, ids = comm.world_size, comm.rank, comm.peer_ids
    left, right = ids[(r - 1) % n], ids[(r + 1) % n]
    out: dict[str, Any] = {}
    # the ring: every peer irecvs from its left and isends to its right, one tag per case
    recvs = [comm.irecv(left, tag=t) for t in range(len(CASES))]
    sends = [comm.isend(_message(r, (r + 1) % n, t, *case), right, tag=t)
             for t, case in enumerate(CASES)]
    out["ring"] = [w.wait() for w in recvs]
    assert [w.wait() for w in sends] == [None] * len(sends)
    # order per tag, tags interleaved; tag 101 is received first
    sends = [comm.isend(np.array([r, tag, k]), right, tag=tag) for k in range(3)
             for tag in (100, 101)]
    out["order"] = [comm.recv(left, tag=101) for _ in range(3)] + [
        comm.recv(left, tag=100) for _ in range(3)]
    for w in sends:
        w.wait()
    # several parts, blocking: rank 0 to the last rank (to itself with one peer)
    big = np.arange(BIG, dtype=np.float64) * (r + 1)
    if n == 1:
        w = comm.isend(big, ids[0], tag=7)
        out["big"] = comm.recv(ids[0], tag=7)
        w.wait()
    elif r == 0:
        comm.send(big, ids[-1], tag=7)
    elif r == n - 1:
        out["big"] = comm.recv(ids[0], tag=7)
    # out=: the sender's dtype and shape, then another one (refused on both sides)
    buf = np.full(4, -1.0, np.float32)
    w = comm.isend(np.arange(4, dtype=np.float32) + r, right, tag=200)
    out["out_is_buf"] = comm.recv(left, tag=200, out=buf) is buf
    out["out"] = buf
    w.wait()
    w = comm.isend(np.arange(5, dtype=np.int64), right, tag=201)
    with pytest.raises(MismatchError) as on_recv:
        comm.recv(left, tag=201, out=np.empty(4, np.float32))
    with pytest.raises(MismatchError) as on_send:
        w.wait()
    out["mismatch"] = (str(on_recv.value), str(on_send.value))
    # point to point never waits behind a queued collective
    ones = np.ones(2)
    if n > 1 and r == 0:
        reduced = comm.all_reduce(ones, async_op=True)  # waits for rank 1 to join
        comm.send(np.array([42]), ids[1], tag=300)
        out["sum"] = reduced.wait()
    elif n > 1 and r == 1:
        out["unqueued"] = comm.recv(ids[0], tag=300)
        out["sum"] = comm.all_reduce(ones)
    else:
        out["sum"] = comm.all_reduce(ones)
    return out


def _check(results: dict[int, Any], n: int) -> None:
    assert sorted(results) == list(range(n))
    ids = [_pid(r) for r in range(n)]
    for r, got in results.items():
        assert not isinstance(got, BaseException), (r, got)
        left, right = (r - 1) % n, (r + 1) % n
        for t, case in enumerate(CASES):
            _same(got["ring"][t], _message(left, r, t, *case), (r, t, case))
        want = [np.array([left, 101, k]) for k in range(3)] + [
            np.array([left, 100, k]) for k in range(3)]
        for g, w in zip(got["order"], want, strict=True):
            _same(g, w, (r, "order"))
        if r == n - 1:
            _same(got["big"], np.arange(BIG, dtype=np.float64), (r, "big"))
        assert got["out_is_buf"]
        _same(got["out"], np.arange(4, dtype=np.float32) + left, (r, "out"))
        assert got["mismatch"] == (
            f"recv from peer {ids[left]} (tag 201) on peer {ids[r]}: the message is int64[5] "
            "but out is float32[4]; they must match",
            f"send from peer {ids[r]} to peer {ids[right]} (tag 201): peer {ids[right]} "
            "refused the message: its recv(out=...) takes float32[4], the message is int64[5]")
        _same(got["sum"], np.full(2, float(n)), (r, "sum"))
        if n > 1 and r == 1:
            _same(got["unqueued"], np.array([42]), (r, "unqueued"))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_point_to_point_between_the_threads_of_one_node(n: int) -> None:
    results = run_peers(burncoll.CollectiveConfig(num_devices=n, timeout=20),
                        lambda comm, i: _exchange(comm), peer_ids=[_pid(r) for r in range(n)])
    _check(dict(enumerate(results)), n)


def _run_nodes(address: str, transport: str, nodes: int, devices: int,
               fn: Callable[[burncoll.Communicator], Any],
               timeouts: list[float] | None = None) -> dict[int, Any]:
    """``fn`` on every peer of ``nodes`` nodes of ``devices`` threads (node ``i``'s config
    has ``timeouts[i]``); each peer's result or error, by rank."""
    return run_nodes(address, nodes, devices, fn, transport=transport,
                     timeout=timeouts or 20.0, peer_id=_pid)


@pytest.mark.parametrize(("transport", "nodes", "devices"), [
    ("websocket", 2, 1), ("quic", 2, 2), ("websocket", 3, 2),
])
def test_point_to_point_across_nodes(transport: str, nodes: int, devices: int) -> None:
    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        results = _run_nodes(orch.address, transport, nodes, devices, _exchange)
    _check(results, nodes * devices)


# -- timeouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["recv", "send"])
def test_a_peer_that_never_answers_times_out_naming_it(call: str) -> None:
    """One node, two threads: peer 7 receives from (or sends to) peer 12, which does
    nothing; peer 7's call ends after the timeout naming peer 12 and the tag, and the
    collective is aborted (peer 12's finish returns, a later call raises at once)."""
    def work(comm: burncoll.Communicator, i: int) -> Any:
        if i == 1:
            return None
        with pytest.raises(CollectiveTimeout) as info:
            if call == "recv":
                comm.recv(12, tag=3)
            else:
                comm.send(np.ones(3), 12, tag=3)
        with pytest.raises(CollectiveAborted):
            comm.isend(np.ones(1), 12)
        return str(info.value)

    results = run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=2), work,
                        peer_ids=[7, 12])
    assert results[1] is None
    words = ("recv from peer 12 (tag 3) on peer 7 timed out" if call == "recv" else
             "send from peer 7 to peer 12 (tag 3) timed out")
    assert words in results[0] and "after 2 s" in results[0], results[0]


@pytest.mark.parametrize("call", ["recv", "send"])
def test_across_nodes_a_timeout_names_the_peer_and_reaches_every_node(call: str) -> None:
    """Node 0 (timeout 2 s) receives from (or sends to) node 1's peer, which waits for
    something else (timeout 20 s): both end with node 0's CollectiveTimeout."""
    def work(comm: burncoll.Communicator) -> BaseException | None:
        try:
            if comm.rank == 0 and call == "recv":
                comm.recv(_pid(1), tag=3)
            elif comm.rank == 0:
                comm.send(np.ones(3), _pid(1), tag=3)
            else:
                comm.recv(_pid(0), tag=4)
        except burncoll.CollectiveError as exc:
            return exc
        return None

    with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
        results = _run_nodes(orch.address, "websocket", 2, 1, work, timeouts=[2.0, 20.0])
    words = (f"recv from peer {_pid(1)} (tag 3) on peer {_pid(0)} timed out" if call == "recv"
             else f"send from peer {_pid(0)} to peer {_pid(1)} (tag 3) timed out")
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveTimeout), results
        assert words in str(results[rank]), results[rank]
    assert f"peer {_pid(1)} (node 1 " in str(results[0])


_DYING_NODE = """
import os, sys, time
import burncoll
cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=1, global_address=sys.argv[1],
                                transport="websocket", timeout=20)
burncoll.register(12, 0, cfg)
time.sleep(1.0)
os._exit(3)  # dies without receiving, without finish
"""


def test_a_send_to_a_node_that_died_raises_peer_lost_naming_it() -> None:
    """Node 1 (a child process) registers, then dies: node 0's send to its peer raises
    PeerLost naming node 1, not a timeout."""
    with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
        child = subprocess.Popen([sys.executable, "-c", _DYING_NODE, orch.address],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def work(comm: burncoll.Communicator) -> BaseException | None:
                try:
                    comm.send(np.ones(3), 12, tag=2)
                except burncoll.CollectiveError as exc:
                    return exc
                return None

            cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=0, global_address=orch.address,
                                            transport="websocket", timeout=20)
            (error,) = run_peers(cfg, lambda comm, i: work(comm), peer_ids=[7])
        finally:
            assert child.wait(30) == 3
    assert isinstance(error, burncoll.PeerLost), error
    assert "node 1 (peers [12]" in str(error), error


# -- misuse -------------------------------------------------------------------------------------
def test_misuse_is_a_usage_error_at_once_and_the_collective_goes_on() -> None:
    def work(comm: burncoll.Communicator, i: int) -> Any:
        other = 12 if comm.peer_id == 7 else 7
        x = np.ones(3)
        for call, words in [
            (lambda: comm.send(x, 5), "dst=5 is not a peer of this collective; peer ids are "
                                      "[7, 12]"),
            (lambda: comm.irecv(99), "src=99 is not a peer"),
            (lambda: comm.isend(x, True), "dst must be a peer id (an int), got True"),
            (lambda: comm.recv("7"), "src must be a peer id"),
            (lambda: comm.isend(x, other, tag=-1), "tag must be an int from 0 to 65535"),
            (lambda: comm.send(x, other, tag=65536), "tag must be an int from 0 to 65535"),
            (lambda: comm.irecv(other, tag=1.0), "got 1.0"),
            (lambda: comm.send(x, comm.peer_id), "a blocking send to yourself"),
            (lambda: comm.isend([1, 2], other), "expected an array of backend 'numpy'"),
            (lambda: comm.isend(x.astype(object), other), "dtype object is not supported"),
            (lambda: comm.recv(other, out=np.ones(4)[::2]), "writable and C-contiguous"),
            (lambda: comm.irecv(other, out=[0.0]), "out must be an array"),
        ]:
            with pytest.raises(UsageError) as info:
                call()
            assert words in str(info.value), (words, str(info.value))
        w = comm.isend(np.arange(3.0).astype(">f8"), other)  # big-endian: sent as native
        got = comm.recv(other)
        w.wait()
        return got

    for got in run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=10), work,
                         peer_ids=[7, 12]):
        _same(got, np.arange(3.0), "after")


def test_the_sender_may_change_its_array_once_send_returns() -> None:
    """Between threads the post office holds a copy: the receiver gets what was sent, not
    what the sender wrote into its array afterwards."""
    def work(comm: burncoll.Communicator, i: int) -> Any:
        if i == 0:
            x = np.arange(4.0)
            w = comm.isend(x, 12)
            x[:] = -1
            comm.send(x, 12, tag=1)
            x[:] = -2
            w.wait()
            return None
        return [comm.recv(7, tag=1), comm.recv(7)]

    got = run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=10), work,
                    peer_ids=[7, 12])[1]
    _same(got[0], np.full(4, -1.0), "second")
    _same(got[1], np.arange(4.0), "first")


def test_jax_peers_send_and_receive_jax_arrays_on_their_devices() -> None:
    jax = pytest.importorskip("jax")
    devices = burncoll.get_backend("jax").devices(2)
    cfg = burncoll.CollectiveConfig(backend="jax", num_devices=2, timeout=10)

    def work(comm: burncoll.Communicator, i: int) -> Any:
        other = 1 - i
        w = comm.isend(jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3) + i,
                                      devices[i]), other, tag=4)
        got = comm.irecv(other, tag=4).wait()
        w.wait()
        with pytest.raises(UsageError, match="immutable"):
            comm.irecv(other, out=got)
        return got

    for i, got in enumerate(run_peers(cfg, work)):
        assert isinstance(got, jax.Array), got
        assert got.devices() == {devices[i]}
        _same(got, np.arange(6, dtype=np.float32).reshape(2, 3) + (1 - i), i)


# -- finish and messages in flight ------------------------------------------------------------
@pytest.mark.parametrize("transport", ["websocket", "quic"])
def test_finish_waits_for_an_isend_or_irecv_in_flight(transport: str) -> None:
    """A peer that finishes right after ``isend`` (or ``irecv``) without waiting: its node
    stays until the message is taken (or has come), as MPI has requests completed before a
    process leaves; the other side, which sends or receives late, gets the right array."""
    late = 0.5
    message = np.arange(1000.0) * 3 - 7

    def work(comm: burncoll.Communicator) -> Any:
        other = next(p for p in comm.peer_ids if p != comm.peer_id)
        if comm.rank == 0:
            sent = comm.isend(message.copy(), other)  # never waited
            pending = comm.irecv(other, tag=1)  # nor this one
            comm.finish()
            return pending, sent.is_completed(), pending.is_completed()
        time.sleep(late)
        got = comm.recv(other)
        comm.send(got * 2, other, tag=1)
        return got

    with burncoll.start_orchestrator(transport=transport, expected_nodes=2) as orch:
        results = _run_nodes(orch.address, transport, 2, 1, work)
    _same(results[1], message, "the isend the sender never waited for")
    assert isinstance(results[0], tuple), results[0]
    pending, sent_done, received_done = results[0]
    assert sent_done and received_done  # finish returned once both were complete
    _same(pending.result(), message * 2, "the irecv the receiver never waited for")
