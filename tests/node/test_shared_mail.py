"""Small all-reduces and barriers through the shared mail among node processes of one host
(:mod:`burncoll.node.shared_mail`).

Real node processes through a real orchestrator (this file, run as a script, is one node):
many back-to-back all-reduces of 8 B to 64 KiB (and 256 KiB, and 1 MiB on the sockets, between
2 nodes), every reduce op,
several dtypes, fresh results, ``out=`` and in place, and barriers between them, each input
new (a message read from a slot too early or too late gives a wrong result), each result
compared with NumPy in float64 and bitwise identical on every node; the mail was used for
them. A node process that dies while the others wait in the mail is named by every survivor
at once. Then nodes as threads of this process (one host too): a node that never calls times
the others out by their deadline, naming it; different sizes are a mismatch on every node; a
node that cannot make its segment leaves every node on the caller sockets, with correct
results; a processor without ordered stores keeps the exchange on the sockets (the route says
so from the first operation); and nodes of two devices exchange their sums through the mail.
Last, the futex the mail sleeps on, between real threads.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.segments as segments_module
from burncoll.levels import Exchange, Medium
from burncoll.node.segments import segment_bytes
from burncoll.node.shared_mail import SLOT_BYTES, Futex, SharedMail
from tests.harness import (
    all_reduce_as,
    reduced_float64,
    register_node_process,
    run_node_processes,
    run_nodes,
)

#: Each call: (dtype, elements, reduce op, how the result is asked for); ``barrier`` between.
CALLS = [("float32", 2, "sum", "fresh"),  # 8 B
         ("int64", 1, "prod", "in place"),
         ("float64", 512, "max", "out"),  # 4 KiB
         ("float32", 16_384, "sum", "fresh"),  # 64 KiB
         ("int32", 1_000, "mean", "fresh"),  # (integers: a float64 mean)
         ("float64", 3, "min", "in place")]
#: Between 2 nodes also (exchanges of 2 nodes go up to 2 MiB): 256 KiB through the mail,
#: 1 MiB past its slots, on the caller sockets, in between.
BIG = [("float32", 1 << 16, "sum", "out"), ("float64", 1 << 17, "max", "fresh")]
ROUNDS = 8


def _input(node: int, i: int, call: tuple[str, int, str, str]) -> np.ndarray:
    dtype, n, op, _ = call
    rng = np.random.default_rng(7919 * i + node)
    if op == "prod":
        return rng.choice(np.array([-3, 1, 2], dtype), n)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _reference(nodes: int, i: int, call: tuple[str, int, str, str]) -> np.ndarray:
    return reduced_float64(np.stack([_input(n, i, call) for n in range(nodes)]), call[2])


def _call(comm: burncoll.Communicator, x: np.ndarray, call: tuple[str, int, str, str]
          ) -> np.ndarray:
    return all_reduce_as(comm, x, call[2], call[3])


def _posted(comm: burncoll.Communicator) -> int:
    """Messages this node posted in the mail (0: no mail)."""
    mail = comm._server.link._lanes.mail  # type: ignore[attr-defined]
    return 0 if mail is None else int(mail.posted_count)


def _node_main(argv: list[str]) -> None:
    """``NODE NODES ORCH_ADDRESS TRANSPORT DIES`` (``DIES``: the node that exits in the
    middle, or -1): print one JSON record."""
    comm, node, nodes, dies = register_node_process(argv)
    calls = [*CALLS, *BIG] if nodes == 2 else CALLS
    record: dict[str, Any] = {"node": node, "error": 0.0, "calls": 0}
    digest = hashlib.sha256()
    started = time.monotonic()
    try:
        for i in range(ROUNDS):
            for call in calls:
                if i == 2 and node == dies:
                    time.sleep(0.3)  # the others wait in the mail
                    os._exit(3)  # a process that dies: its sockets close with it
                started = time.monotonic()
                got = _call(comm, _input(node, i, call), call)
                want = _reference(nodes, i, call)
                record["error"] = max(record["error"], float(np.max(
                    np.abs(got.astype(np.float64) - want) / (1.0 + np.abs(want)))))
                digest.update(got.tobytes())
                record["calls"] += 1
            comm.barrier()
        record["posted"] = _posted(comm)
        comm.finish()
    except burncoll.CollectiveError as exc:
        record["raised"] = f"{type(exc).__name__}: {exc}"
        record["seconds"] = time.monotonic() - started
    record["sha"] = digest.hexdigest()
    print(json.dumps(record), flush=True)


def _run_processes(nodes: int, transport: str, dies: int = -1) -> list[dict[str, Any]]:
    return run_node_processes(__file__, nodes, transport, dies)


@pytest.mark.parametrize(("nodes", "transport"), [(2, "tcp"), (4, "websocket")])
def test_node_processes_of_one_host_exchange_through_the_mail(nodes: int, transport: str
                                                              ) -> None:
    records = _run_processes(nodes, transport)
    assert len(records) == nodes
    calls = ROUNDS * (len(CALLS) + 2 * (nodes == 2))
    for record in records:
        assert "raised" not in record, record
        assert record["calls"] == calls, record
        assert record["error"] <= 1e-5, record  # (float32 sums; every other call exact)
        # every call and barrier went through the mail but the 1 MiB ones (and the segments'
        # 2 set-up rounds on the sockets, which post nothing)
        assert record["posted"] == calls + ROUNDS - ROUNDS * (nodes == 2), record
    assert len({r["sha"] for r in records}) == 1  # the same bits on every node


def test_a_node_process_that_dies_is_named_by_every_survivor_at_once() -> None:
    records = _run_processes(3, "tcp", dies=2)
    assert len(records) == 2
    for record in records:
        assert record["raised"].startswith(("PeerLost", "CollectiveAborted")), record
        assert "node 2" in record["raised"], record
        assert record["seconds"] < 20.0 / 2, record  # half the timeout: not at the deadline


# -- nodes as threads of this process -----------------------------------------------------

def _threads(nodes: int, fn: Any, timeout: float = 20.0, **config: Any) -> dict[int, Any]:
    with burncoll.start_orchestrator(transport="tcp") as orch:
        return run_nodes(orch.address, nodes, 1, fn, transport="tcp", timeout=timeout,
                         **config)


def _small_calls(comm: burncoll.Communicator) -> tuple[list[np.ndarray], int, list[Any]]:
    got = [_call(comm, _input(comm.rank, i, call), call)
           for i, call in enumerate(CALLS * 2)]
    comm.barrier()
    return got, _posted(comm), list(comm._server.plans.values())  # type: ignore[attr-defined]


def _check_small_calls(out: dict[int, Any], nodes: int, posted: int,
                       medium: Medium = Medium.HOST) -> None:
    """Every node's results are right and the same, it posted ``posted`` messages, and
    every exchange of its plans took ``medium``."""
    for rank in range(nodes):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, count, plans = out[rank]
        assert count == posted, count
        assert {plan.route for plan in plans} == {Exchange(medium)}, plans
        for i, call in enumerate(CALLS * 2):
            np.testing.assert_allclose(got[i], _reference(nodes, i, call), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[i], out[0][0][i])


def test_a_node_that_never_calls_times_out_the_others() -> None:
    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()  # (the mail is set up)
        if comm.rank == 1:
            time.sleep(4.0)
            return None
        started = time.monotonic()
        try:
            comm.all_reduce(np.ones(2, np.float32))
        except burncoll.CollectiveTimeout as exc:
            return exc, time.monotonic() - started
        raise AssertionError("the all-reduce returned without node 1")

    timeout = 1.5
    out = _threads(2, fn, timeout=timeout)
    error, waited = out[0]
    assert "node 1" in str(error) or "[1]" in str(error), error
    assert timeout - 0.5 <= waited < 3 * timeout, waited  # at its deadline, not never


def test_different_sizes_are_a_mismatch_on_every_node() -> None:
    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        return comm.all_reduce(np.ones(100 + 10 * (comm.rank == 2), np.float32))

    out = _threads(3, fn)
    for rank in range(3):
        assert isinstance(out[rank], burncoll.MismatchError), out[rank]
        assert "100" in str(out[rank]) and "110" in str(out[rank]), out[rank]


def test_a_barrier_against_an_all_reduce_is_a_mismatch_on_every_node() -> None:
    """The barrier's message is shorter than the other call's header: the report reads that
    header whole (not "a malformed message")."""
    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        if comm.rank == 0:
            return comm.barrier()
        return comm.all_reduce(np.ones(2, np.float32))

    out = _threads(2, fn)
    for rank in range(2):
        assert isinstance(out[rank], burncoll.MismatchError), out[rank]
        assert "barrier" in str(out[rank]) and "all_reduce" in str(out[rank]), out[rank]


def test_two_nodes_make_segments_of_the_mail_alone() -> None:
    """Below 3 nodes the segments' all-reduce is not used: a segment is the mail only."""
    def fn(comm: burncoll.Communicator) -> Any:
        comm.barrier()
        maps = comm._server.link._segments._maps  # type: ignore[attr-defined]
        return sorted(len(m) for m in maps.values())

    out = _threads(2, fn)
    for rank in range(2):
        assert out[rank] == [segment_bytes(2)] * 2, out[rank]
    assert segment_bytes(2) <= 2 << 20 < segment_bytes(3)


def test_a_node_without_its_segment_leaves_every_node_on_the_sockets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real, taken = segments_module.new_ring, []

    def new_ring(token: str, size: int, **kwargs: Any) -> tuple[int, mmap.mmap]:
        taken.append(token)
        if len(taken) == 1:
            raise OSError(12, "Cannot allocate memory (a test double)")
        return real(token, size, **kwargs)

    monkeypatch.setattr(segments_module, "new_ring", new_ring)
    _check_small_calls(_threads(2, _small_calls), 2, posted=0, medium=Medium.LANE)


def test_a_processor_without_ordered_stores_keeps_the_exchange_on_the_sockets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host memory is set up (3 nodes: for the host reduction), without its mail: the
    routes take the lanes from the first operation."""
    monkeypatch.setattr(segments_module, "ORDERED_STORES", False)
    _check_small_calls(_threads(3, _small_calls), 3, posted=0, medium=Medium.LANE)


def test_the_mail_carries_the_small_calls_of_thread_nodes_too() -> None:
    _check_small_calls(_threads(3, _small_calls), 3, posted=2 * len(CALLS) + 1)


@pytest.mark.parametrize("local", ["auto", "ring"])
def test_nodes_of_two_devices_exchange_their_sums_through_the_mail(local: str) -> None:
    """Each node reduces its 2 devices' arrays (inline under ``auto``, a local ring
    otherwise), and its leader exchanges the node's sum through the mail."""
    sizes = (3, 1000, 16_000)  # 12 B, 4 KB, 64 KB of float32 per peer
    xs = {(r, n): np.random.default_rng(10 * r + n).standard_normal(n).astype(np.float32)
          for r in range(4) for n in sizes}

    def fn(comm: burncoll.Communicator) -> Any:
        got = [comm.all_reduce(xs[comm.rank, n]) for n in sizes]
        comm.barrier()
        return got, _posted(comm)

    with burncoll.start_orchestrator(transport="tcp") as orch:
        out = run_nodes(orch.address, 2, 2, fn, transport="tcp", timeout=20.0,
                        local_all_reduce_strategy=local)
    for rank in range(4):
        assert not isinstance(out[rank], BaseException), out[rank]
        got, posted = out[rank]
        assert posted == len(sizes) + 1  # (every all-reduce and the barrier: one post each)
        for i, n in enumerate(sizes):
            want = reduced_float64(np.stack([xs[r, n] for r in range(4)]), "sum")
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[i], out[0][0][i])


def test_a_message_larger_than_a_slot_is_refused_and_never_posted() -> None:
    """``choose`` sends through the mail only what fits a slot; a message past it (a wrong
    route) would write into the other slot, which another node may still read: refused,
    and the counter stays."""
    maps = {n: mmap.mmap(-1, 2 << 20) for n in (0, 1)}
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
    maps = {n: mmap.mmap(-1, 2 << 20) for n in (0, 1)}
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
