"""A hypothesis state machine drives the rendezvous: random operations, arrival orders and
failures, on real peer threads through the public API.

Each step picks an operation and an order in which the peers arrive (each waits until the one
before has taken its sequence number), or a fault: a peer that passes other arguments
(:class:`~burncoll.MismatchError` on every peer), a peer that never calls
(:class:`~burncoll.CollectiveTimeout` naming it), a peer that misuses the API
(:class:`~burncoll.UsageError` on that peer alone, the collective still usable), ``finish``.
After a failure every call raises :class:`~burncoll.CollectiveAborted` at once until the peers
register again. Results are checked against NumPy in float64; no step may hang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import burncoll

PEERS = 3
#: Short, since the "missing peer" step waits for it; normal steps take milliseconds.
TIMEOUT = 0.6
KINDS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "barrier")
OPS = ("sum", "mean", "max", "min", "prod")
DTYPES = ("float64", "float32", "int32")
#: A result must come back within this; anything longer is a hang.
STEP_LIMIT = TIMEOUT * 4 + 5


class PeerThread:
    """One peer: a thread that runs what it is given, in order (as an application would)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pool = concurrent.futures.ThreadPoolExecutor(1, f"peer-{index}")
        self.comm: burncoll.Communicator | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        return self.pool.submit(fn)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _values(kind: str, dtype: str, n: int, pid: int, seq: int, op: str) -> np.ndarray:
    rows = 1 + (n + pid) % 4 if kind == "all_gather" else n
    base = (np.arange(rows * 2, dtype=np.int64) * 5 + pid * 3 + seq) % 7 - 3
    if op == "prod":
        base = base % 3 + 1  # products stay small and exact
    return base.astype(dtype).reshape(rows, 2)


def _expected(
    kind: str, op: str, dtype: str, n: int, pid: int, seq: int, root: int
) -> np.ndarray | None:
    xs = [_values(kind, dtype, n, p, seq, op).astype(np.float64) for p in range(PEERS)]
    if kind == "barrier" or (kind == "reduce" and pid != root):
        return None
    if kind == "broadcast":
        return xs[root]
    if kind == "all_gather":
        return np.concatenate(xs)
    reduce: Any = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op]
    full: np.ndarray = np.asarray(reduce(np.stack(xs), axis=0))
    if op == "mean":
        full = full / PEERS
    if kind == "reduce_scatter":
        return np.array_split(full, PEERS)[pid]
    return full


def _call(comm: burncoll.Communicator, kind: str, op: str, x: np.ndarray | None, root: int) -> Any:
    if kind == "all_reduce":
        return comm.all_reduce(x, op=op)
    if kind == "reduce":
        return comm.reduce(x, root=root, op=op)
    if kind == "broadcast":
        return comm.broadcast(x, root=root)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, op=op)
    if kind == "all_gather":
        return comm.all_gather(x)
    return comm.barrier()


def _outcome(future: concurrent.futures.Future[Any]) -> Any:
    """The result, or the exception raised (a hang fails the test)."""
    done, _ = concurrent.futures.wait([future], STEP_LIMIT)
    if not done:
        raise AssertionError(f"a peer hung for {STEP_LIMIT} s")
    error = future.exception()
    return error if error is not None else future.result()


class RendezvousMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = burncoll.CollectiveConfig(num_devices=PEERS, timeout=TIMEOUT)
        self.peers = [PeerThread(i) for i in range(PEERS)]
        self.seq = 0  # the next operation's sequence number (same on every peer)
        self.aborted = False
        self.finished = False

    def teardown(self) -> None:
        for p in self.peers:
            if p.comm is not None:
                p.submit(functools.partial(_quietly, p.comm.finish))
        for p in self.peers:
            p.close()

    # -- helpers ------------------------------------------------------------------------------
    def register_all(self) -> None:
        def reg(peer: PeerThread) -> None:
            peer.comm = burncoll.register(peer.index, peer.index, self.config)

        futures = [p.submit(functools.partial(reg, p)) for p in self.peers]
        for f in futures:
            f.result(STEP_LIMIT)
        self.seq, self.aborted, self.finished = 0, False, False

    def comm(self, index: int) -> burncoll.Communicator:
        comm = self.peers[index].comm
        assert comm is not None
        return comm

    def server_status(self) -> dict[str, Any]:
        return self.comm(0)._server.status()

    def arrive_in_order(
        self, order: list[int], calls: dict[int, Callable[[], Any]]
    ) -> dict[int, Any]:
        """Submit each peer's call in ``order``; each waits until the previous one has taken
        its sequence number (has arrived), unless the collective is already aborted."""
        futures: dict[int, concurrent.futures.Future[Any]] = {}
        for i in order:
            futures[i] = self.peers[i].submit(calls[i])
            if self.aborted or self.finished:
                continue
            deadline = time.monotonic() + 5
            while (
                int(self.server_status()["next_seq"][i]) <= self.seq
                and not futures[i].done()
                and time.monotonic() < deadline
            ):
                time.sleep(0.0005)
        return {i: _outcome(f) for i, f in futures.items()}

    def expect_aborted_everywhere(self, outcomes: dict[int, Any]) -> None:
        for i, r in outcomes.items():
            if self.finished:
                assert isinstance(r, burncoll.UsageError) and "after finish" in str(r), r
            else:
                assert isinstance(r, burncoll.CollectiveAborted), (i, r)
                assert isinstance(r.__cause__, burncoll.CollectiveError)

    # -- rules --------------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.register_all()

    @rule(
        kind=st.sampled_from(KINDS),
        op=st.sampled_from(OPS),
        dtype=st.sampled_from(DTYPES),
        n=st.integers(0, 9),
        root=st.integers(0, PEERS - 1),
        order=st.permutations(list(range(PEERS))),
    )
    def operation(
        self, kind: str, op: str, dtype: str, n: int, root: int, order: list[int]
    ) -> None:
        seq = self.seq

        def call(i: int) -> Callable[[], Any]:
            x = None if kind == "barrier" else _values(kind, dtype, n, i, seq, op)
            if kind == "broadcast" and i != root and i % 2:
                x = None
            return lambda: _call(self.comm(i), kind, op, x, root)

        started = time.monotonic()
        outcomes = self.arrive_in_order(order, {i: call(i) for i in range(PEERS)})
        if self.aborted or self.finished:
            self.expect_aborted_everywhere(outcomes)
            assert time.monotonic() - started < TIMEOUT, "an aborted call waited"
            return
        self.seq += 1
        for i, got in outcomes.items():
            assert not isinstance(got, Exception), (kind, op, dtype, n, i, got)
            want = _expected(kind, op, dtype, n, i, seq, root)
            if want is None:
                assert got is None
                continue
            assert isinstance(got, np.ndarray) and got.shape == want.shape, (got, want)
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-6)

    @rule(
        culprit=st.integers(0, PEERS - 1),
        what=st.sampled_from(["shape", "dtype", "op", "root", "kind"]),
        order=st.permutations(list(range(PEERS))),
    )
    def mismatch(self, culprit: int, what: str, order: list[int]) -> None:
        def call(i: int) -> Callable[[], Any]:
            odd = i == culprit
            x = np.ones(
                4 + (odd and what == "shape"),
                dtype=np.float32 if odd and what == "dtype" else np.float64,
            )
            comm = self.comm(i)
            if what == "op":
                return lambda: comm.all_reduce(x, op="max" if odd else "sum")
            if what == "root":
                return lambda: comm.reduce(x, root=(culprit + 1) % PEERS if odd else culprit)
            if what == "kind" and odd:
                return comm.barrier
            return lambda: comm.all_reduce(x)

        outcomes = self.arrive_in_order(order, {i: call(i) for i in range(PEERS)})
        if self.aborted or self.finished:
            self.expect_aborted_everywhere(outcomes)
            return
        for i, r in outcomes.items():
            assert isinstance(r, burncoll.MismatchError), (i, r)
            assert f"#{self.seq}" in str(r)
            for pid in range(PEERS):
                assert f"peer {pid}:" in str(r)
        self.aborted = True

    @rule(absent=st.integers(0, PEERS - 1))
    def missing_peer(self, absent: int) -> None:
        present = [i for i in range(PEERS) if i != absent]
        futures = {
            i: self.peers[i].submit(functools.partial(self.comm(i).all_reduce, np.ones(3)))
            for i in present
        }
        outcomes = {i: _outcome(f) for i, f in futures.items()}
        if self.aborted or self.finished:
            self.expect_aborted_everywhere(outcomes)
            return
        for i, r in outcomes.items():
            assert isinstance(r, burncoll.CollectiveTimeout), (i, r)
            assert f"all_reduce #{self.seq}" in str(r) and f"[{absent}]" in str(r)
            assert "never called" in str(r)
        # the absent peer comes late: the collective is aborted by then
        late = _outcome(self.peers[absent].submit(lambda: self.comm(absent).barrier()))
        assert isinstance(late, burncoll.CollectiveAborted), late
        self.aborted = True

    @rule(culprit=st.integers(0, PEERS - 1), order=st.permutations(list(range(PEERS))))
    def usage_error_then_right_call(self, culprit: int, order: list[int]) -> None:
        seq = self.seq

        def call(i: int) -> Callable[[], Any]:
            comm = self.comm(i)
            x = np.full(2, float(i + 1))
            if i != culprit:
                return lambda: comm.all_reduce(x)

            def wrong_then_right() -> Any:
                try:
                    comm.reduce(x, root=PEERS + 5)
                except burncoll.UsageError as exc:  # raised before anything is sent
                    assert "not a peer" in str(exc)
                else:
                    raise AssertionError("no UsageError")
                return comm.all_reduce(x)

            return wrong_then_right

        outcomes = self.arrive_in_order(order, {i: call(i) for i in range(PEERS)})
        if self.aborted or self.finished:
            self.expect_aborted_everywhere(outcomes)
            return
        self.seq = seq + 1
        for r in outcomes.values():
            np.testing.assert_array_equal(r, np.full(2, 6.0))

    @rule()
    def finish(self) -> None:
        futures = [p.submit(self.comm(i).finish) for i, p in enumerate(self.peers)]
        for r in map(_outcome, futures):
            assert r is None or isinstance(r, burncoll.UsageError), r
        self.finished = True

    @rule()
    def register_again(self) -> None:
        self.register_all()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def nothing_left_inside(self) -> None:
        """Between steps no operation is half-done on a healthy server."""
        if self.aborted or self.finished or self.peers[0].comm is None:
            return
        status = self.server_status()
        assert status["arrived"] == {}, status
        assert set(status["next_seq"].values()) == {self.seq}, status


def _quietly(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(burncoll.CollectiveError):
        fn()


RendezvousMachine.TestCase.settings = settings(
    max_examples=8,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
TestRendezvous = pytest.mark.timeout(240)(RendezvousMachine.TestCase)
