"""Caller sockets (``burncoll.node.lanes``): the calling thread's own connection per node pair.

Two levels. The exchange engine alone, on real connected sockets between real threads: every
message arrives whole, one larger than the sockets' buffers does not deadlock, a silent node
times out at the deadline, a closed one is reported, a session failure wakes the wait, and a
message that announces another length is read no further than its header (nothing is
allocated on its word); a node whose shared mail is in is not blamed for what its lane holds
next. Then real nodes through a real orchestrator, where a member holding
the token (a test double inside its process) writes on its lane what an honest node never
would -- a huge size, another operation's number, another dtype, bytes that are no frame --
or closes it: every node fails with an error that says what was wrong and names that node;
mismatched calls between an exchange and another operation are reported as mismatches; lanes
are used only when every node offers them, and a second lane, or one dialed the wrong way, is
dropped without harming the session. Results are checked against NumPy float64.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.node.host_mail import SharedMail
from burncoll.node.lanes import LaneClosed, LaneOdd, Lanes, LaneTimeout, LaneWoken, _SocketRound
from burncoll.node.spinning import Spinning
from burncoll.protocol.wire import FIXED_HEADER_BYTES, decode_data_head, encode_data_header
from tests.harness import run_nodes

# -- the engine, on socket pairs ------------------------------------------------------------


def _pair() -> tuple[Lanes, Lanes]:
    """Node 0's and node 1's lanes, joined by one real connected socket pair."""
    a, b = socket.socketpair()
    zero, one = Lanes(), Lanes()
    zero.add(1, a)
    one.add(0, b)
    return zero, one


def _frame(payload: bytes, **fields: Any) -> bytes:
    from burncoll.ops import OpKind, ReduceOp
    from burncoll.protocol.wire import DataHeader

    h = DataHeader(session=7, seq=3, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM,
                   dtype="uint8", shape=(len(payload),), root=-1, src=0, round=0, channel=0,
                   chunk=0, offset=0, chunk_bytes=len(payload))
    h = dataclasses.replace(h, **fields)
    return encode_data_header(h, fields.get("chunk_bytes", len(payload))) + payload


def _both(zero: Lanes, one: Lanes, m0: bytes, m1: bytes, seconds: float = 10.0
          ) -> tuple[Any, Any]:
    """Both exchanges at once, each on its own thread; each one's result or error."""
    out: list[Any] = [None, None]

    def run(i: int, lanes: Lanes, message: bytes, expected: int) -> None:
        try:
            out[i] = lanes.exchange(message, expected, time.monotonic() + seconds)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(0, zero, m0, len(m1))),
               threading.Thread(target=run, args=(1, one, m1, len(m0)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 10)
    assert not any(t.is_alive() for t in threads)
    return out[0], out[1]


@pytest.mark.parametrize("spin", [False, True], ids=["sleeping", "spinning"])
@pytest.mark.parametrize("size", [0, 1, 4096, 8 << 20])  # 8 MiB: over both socket buffers
def test_each_node_receives_the_others_message_whole(size: int, spin: bool) -> None:
    zero, one = _pair()
    zero.spinning.allowed = one.spinning.allowed = spin
    m0 = _frame(np.random.default_rng(0).bytes(size))
    m1 = _frame(np.random.default_rng(1).bytes(size), src=1)
    try:
        got0, got1 = _both(zero, one, m0, m1)
        assert bytes(got0[1]) == m1 and bytes(got1[0]) == m0
        got0, got1 = _both(zero, one, m1, m0)  # and again: nothing of the first is left
        assert bytes(got0[1]) == m0 and bytes(got1[0]) == m1
        assert zero.spinning.average > 0 and one.spinning.average > 0  # the waits counted
    finally:
        zero.close()
        one.close()


@pytest.mark.parametrize("spin", [False, True], ids=["sleeping", "spinning"])
def test_a_silent_node_times_out_at_the_deadline(spin: bool) -> None:
    zero, one = _pair()
    zero.spinning.allowed = spin
    try:
        start = time.monotonic()
        with pytest.raises(LaneTimeout) as caught:
            zero.exchange(_frame(b"x"), len(_frame(b"x")), start + 0.3)
        assert caught.value.node == 1
        assert 0.25 <= time.monotonic() - start < 5
    finally:
        zero.close()
        one.close()


@pytest.mark.parametrize("seconds", [-1.0, 30 * 86400.0])  # past; longer than poll can wait
def test_a_message_already_there_counts_whatever_the_deadline(seconds: float) -> None:
    zero, one = _pair()
    m1 = _frame(b"abc", src=1)
    one.socks[0].sendall(m1)
    select.select([zero.socks[1]], [], [], 5)
    try:
        got = zero.exchange(_frame(b"xyz"), len(m1), time.monotonic() + seconds)
        assert bytes(got[1]) == m1
    finally:
        zero.close()
        one.close()


def test_a_closed_lane_is_reported_with_its_node() -> None:
    zero, one = _pair()
    one.socks[0].close()
    try:
        with pytest.raises(LaneClosed) as caught:
            zero.exchange(_frame(b"x"), len(_frame(b"x")), time.monotonic() + 5)
        assert caught.value.node == 1
    finally:
        zero.close()


@pytest.mark.parametrize("spin", [False, True], ids=["sleeping", "spinning"])
def test_a_failure_of_the_session_wakes_the_waiting_thread(spin: bool) -> None:
    zero, one = _pair()
    zero.spinning.allowed = spin
    try:
        threading.Timer(0.2, zero.wake).start()
        start = time.monotonic()
        with pytest.raises(LaneWoken):
            zero.exchange(_frame(b"x"), len(_frame(b"x")), start + 30)
        assert time.monotonic() - start < 10
        with pytest.raises(LaneWoken):  # and every later exchange at once
            zero.exchange(_frame(b"x"), len(_frame(b"x")), time.monotonic() + 30)
    finally:
        zero.close()
        one.close()


@pytest.mark.parametrize("whole", [True, False], ids=["in", "half"])
def test_a_round_whose_messages_are_in_when_the_session_fails_completes(whole: bool) -> None:
    """Node 1's message is in and the session has failed when node 0's round looks (the
    orchestrator reported node 1 lost: it sent its last message and left; the wake-up is the
    first thing the round sees): what has come in counts, and the round ends with it -- the
    failure is the next operation's (before, the round raised ``LaneWoken``, and a barrier
    every node had passed failed). Half a message is no round: ``LaneWoken``."""
    zero, one = _pair()
    m1 = _frame(b"last", src=1)
    one.socks[0].sendall(m1 if whole else m1[:10])
    select.select([zero.socks[1]], [], [], 5)
    wake, woken = os.pipe()
    os.write(woken, b"!")
    round_ = _SocketRound(zero.socks, wake, _frame(b"mine"), len(m1))
    try:
        if whole:
            assert bytes(round_.run(time.monotonic() + 10, Spinning())[1]) == m1
        else:
            with pytest.raises(LaneWoken):
                round_.run(time.monotonic() + 10, Spinning())
    finally:
        zero.close()
        one.close()
        os.close(wake)
        os.close(woken)


@pytest.mark.parametrize(("shape", "announced"), [
    ((64,), 2**40),  # a huge size: nothing is allocated for it
    ((64,), 3),
    ((1,) * 32, 2**40),  # a header longer than this call's whole message
])
def test_another_length_is_read_no_further_than_this_call_or_its_header(
        shape: tuple[int, ...], announced: int) -> None:
    zero, one = _pair()
    expected = len(_frame(bytes(64)))
    odd = _frame(bytes(64), shape=shape, chunk_bytes=announced) + bytes(1000)
    one.socks[0].sendall(odd)
    try:
        with pytest.raises(LaneOdd) as caught:
            zero.exchange(_frame(bytes(64)), expected, time.monotonic() + 5)
        h, payload_len = decode_data_head(memoryview(caught.value.head))
        assert payload_len == announced and h.chunk_bytes == announced and h.shape == shape
        read = max(expected, FIXED_HEADER_BYTES + 8 * len(shape))
        assert len(caught.value.head) == read
        assert len(zero.peek(1 << 16)[1]) == len(odd) - read  # the rest is left unread
    finally:
        zero.close()
        one.close()


def test_an_interrupted_exchange_shuts_every_lane() -> None:
    """An exchange stopped half-way by this node (Ctrl-C during a send that waits for room)
    must not leave the other node a half message that the next one would complete."""
    zero, one = _pair()
    big = _frame(bytes(8 << 20))  # more than the sockets hold: the send waits for room
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident,
                                                    signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt):
            zero.exchange(big, len(big), time.monotonic() + 30)
        with pytest.raises(LaneWoken):  # never again on this node
            zero.exchange(big, len(big), time.monotonic() + 30)
        with pytest.raises(LaneClosed):  # the other node sees the lane shut, not a message
            one.exchange(big, len(big), time.monotonic() + 30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        zero.close()
        one.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def test_close_wakes_a_waiting_exchange_and_closes_once_it_ends() -> None:
    zero, one = _pair()
    out: list[BaseException] = []

    def wait() -> None:
        try:
            zero.exchange(_frame(b"x"), len(_frame(b"x")), time.monotonic() + 30)
        except BaseException as exc:
            out.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    zero.close()  # from another thread: it does not wait for the exchange
    assert time.monotonic() - start < 5
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(out[0], LaneWoken)
    assert zero.socks == {}  # closed by the exchange as it ended
    zero.wake()  # after close: nothing to write to, no error
    one.close()


def test_peek_leaves_what_waits_in_the_socket() -> None:
    zero, one = _pair()
    try:
        one.socks[0].sendall(b"abc")
        select.select([zero.socks[1]], [], [], 5)
        assert zero.peek(10) == {1: b"abc"} == zero.peek(10)
    finally:
        zero.close()
        one.close()


class _LookedJustBefore(SharedMail):
    """Node 0's shared mail, whose first look at the counters comes just before node 1's
    post (a fault injected: the order of two threads on a busy host)."""

    early = True

    def posted(self, node: int, k: int) -> bool:
        if self.early:
            self.early = False
            return False
        return super().posted(node, k)


class _WokenJustAfter(SharedMail):
    """Node 0's shared mail, whose first look at the counters comes just before node 1's post
    and the session fails just after it (a fault injected: the order of threads on a busy
    host)."""

    lanes: Lanes | None = None
    first = True

    def missing(self, nodes: Any, k: int) -> list[int]:
        if self.first:
            self.first = False
            assert self.lanes is not None
            self.lanes.wake()
            return list(nodes)
        return super().missing(nodes, k)


def test_mail_that_is_in_when_the_session_fails_counts() -> None:
    zero, one = _pair()
    zero.drop_sockets()  # (the mail carries the exchange: the wake-up pipe stays)
    maps = {n: mmap.mmap(-1, 2 << 20) for n in (0, 1)}
    try:
        mail = _WokenJustAfter(maps, 0, 0)
        mail.lanes = zero
        SharedMail(maps, 1, 0).post([b"node 1's"])
        zero.yielding.sleeping = 1  # (it sleeps at once: its first step looks at the lanes)
        got = mail.exchange(zero, [b"node 0's"], 8, time.monotonic() + 5.0)
        assert bytes(got[1]) == b"node 1's"
        with pytest.raises(LaneWoken):  # the next operation fails
            mail.exchange(zero, [b"node 0's"], 8, time.monotonic() + 5.0)
    finally:
        zero.close()
        one.close()


def test_a_message_on_the_lane_of_a_node_whose_mail_is_in_is_no_mismatch() -> None:
    """Node 1 posts its mail, then at once sends its next operation's message on its lane (an
    exchange too large for the mail). Node 0, which looked at the counters just before the
    post and at the lanes just after the send, takes node 1's posted message: the lane holds
    a later operation's (before, a benchmark's barrier failed as a mismatch here)."""
    zero, one = _pair()
    maps = {n: mmap.mmap(-1, 2 << 20) for n in (0, 1)}
    try:
        mail = _LookedJustBefore(maps, 0, 0)
        SharedMail(maps, 1, 0).post([b"node 1's"])
        one.socks[0].sendall(_frame(b"\0" * 16, seq=4))
        zero.yielding.sleeping = 1  # (it sleeps at once: its first step looks at the lanes)
        got = mail.exchange(zero, [b"node 0's"], 8, time.monotonic() + 5.0)
        assert bytes(got[1]) == b"node 1's"
        assert len(zero.peek(1 << 10)[1]) > FIXED_HEADER_BYTES  # (left for its operation)
    finally:
        zero.close()
        one.close()


# -- real nodes ---------------------------------------------------------------------------


def _lanes_of(comm: burncoll.Communicator) -> Lanes:
    """The node's lanes (internal: a test double reaches them to inject a fault)."""
    lanes: Lanes = comm._server.link._service.lanes  # type: ignore[attr-defined]
    return lanes


def _two_nodes(fn: Callable[[burncoll.Communicator], Any], transport: str = "tcp",
               timeout: float | list[float] = 10.0, **config: Any) -> dict[int, Any]:
    """Two node processes; their exchanges on the lanes, unless ``shared_memory=True`` (then
    through the shared mail, the lanes only watched: tests/node/test_host_memory.py)."""
    config.setdefault("shared_memory", False)
    with burncoll.start_orchestrator(transport=transport) as orch:
        return run_nodes(orch.address, 2, 1, fn, transport=transport, timeout=timeout,
                         **config)


def test_a_closed_lane_is_the_loss_of_that_node() -> None:
    def fn(comm: burncoll.Communicator) -> Any:
        comm.all_reduce(np.ones(4))
        if comm.peer_id == 1:
            _lanes_of(comm).socks[0].shutdown(socket.SHUT_RDWR)
            time.sleep(0.5)
        return comm.all_reduce(np.ones(4))

    out = _two_nodes(fn)
    assert isinstance(out[0], burncoll.PeerLost) and "node 1" in str(out[0]), out
    assert "caller socket" in str(out[0]), out
    assert isinstance(out[1], burncoll.CollectiveError), out


@pytest.mark.parametrize("mail", [False, True], ids=["lanes", "mail"])
def test_an_exchange_against_another_operation_is_a_mismatch_on_every_node(mail: bool) -> None:
    """Node 0 all-reduces (an exchange on the lanes, or through the shared mail), node 1
    waits for a broadcast from it: neither sends what the other waits for. Node 1, waiting,
    looks at its lanes (and the mail), finds node 0's message there, and reports the mismatch
    to every node, long before the deadline."""
    def fn(comm: burncoll.Communicator) -> Any:
        if comm.peer_id == 0:
            return comm.all_reduce(np.ones(4, np.float32))
        return comm.broadcast(np.ones(4, np.float32), root=0)

    start = time.monotonic()
    out = _two_nodes(fn, timeout=20.0, shared_memory=mail)
    assert time.monotonic() - start < 10, "found only at the deadline"
    for rank in (0, 1):
        assert isinstance(out[rank], burncoll.MismatchError), out
        assert "all_reduce" in str(out[rank]) and "broadcast" in str(out[rank]), out


@pytest.mark.parametrize("mail", [False, True], ids=["lanes", "mail"])
def test_another_operation_sent_to_an_exchange_is_found_at_once(mail: bool) -> None:
    """Node 1, a broadcast's root, sends its frame on the member connection while node 0
    runs the exchange: node 0's mailbox compares it with the exchange's call at once."""
    def fn(comm: burncoll.Communicator) -> Any:
        if comm.peer_id == 1:  # the root only sends: its broadcast returns
            return comm.broadcast(np.ones(4, np.float32), root=1)
        start = time.monotonic()
        try:
            return comm.all_reduce(np.ones(4, np.float32))
        except burncoll.MismatchError as exc:
            return exc, time.monotonic() - start

    start = time.monotonic()
    out = _two_nodes(fn, timeout=20.0, shared_memory=mail)
    error, seconds = out[0]
    assert "all_reduce" in str(error) and "broadcast" in str(error), out
    assert seconds < 10, f"found only after {seconds:.1f} s (the timeout is 20 s)"
    # node 1's finish() learns of the failure too, instead of waiting out its deadline
    assert time.monotonic() - start < 10, "a node's finish() waited out its deadline"


def _uses_lanes(comm: burncoll.Communicator) -> bool:
    return comm._server.link._lanes is not None  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(("transport", "config", "lanes"), [
    ("tcp", {}, True),
    ("websocket", {}, True),
    ("websocket", {"tls": True}, False),  # TLS: the event loop's codec
    ("tcp", {"integrity": True, "auth_token": "t" * 32}, False),  # tags: the same
    ("quic", {}, False),
])
def test_lanes_are_used_where_the_transport_sends_plain_bytes(
        transport: str, config: dict[str, Any], lanes: bool) -> None:
    xs = [np.random.default_rng(r).standard_normal(300) for r in range(2)]
    want = xs[0].astype(np.float64) + xs[1]

    def fn(comm: burncoll.Communicator) -> Any:
        got = [comm.all_reduce(xs[comm.peer_id].copy(), op=op) for op in ("sum", "max")]
        comm.barrier()
        return _uses_lanes(comm), got

    with burncoll.start_orchestrator(transport=transport, **config) as orch:
        out = run_nodes(orch.address, 2, 1, fn, transport=transport, **config)
    for rank in (0, 1):
        assert not isinstance(out[rank], BaseException), out
        used, (total, biggest) = out[rank]
        assert used is lanes
        np.testing.assert_allclose(total, want, rtol=1e-12)
        np.testing.assert_array_equal(biggest, np.maximum(xs[0], xs[1]))


def test_lanes_are_used_only_when_every_node_offers_them(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    x = np.arange(8.0)
    with burncoll.start_orchestrator(transport="tcp") as orch:
        out: dict[int, Any] = {}

        def node(rank: int, lanes: bool) -> None:
            cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=rank, num_devices=1,
                                            global_address=orch.address, transport="tcp",
                                            timeout=10, caller_sockets=lanes)
            comm = burncoll.register(rank, 0, cfg)
            try:
                out[rank] = (_uses_lanes(comm), comm.all_reduce(x.copy()))
            finally:
                comm.finish()

        threads = [threading.Thread(target=node, args=(0, True)),
                   threading.Thread(target=node, args=(1, False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert out[0][0] is False and out[1][0] is False, out
    for rank in (0, 1):
        np.testing.assert_array_equal(out[rank][1], 2 * x)


@pytest.mark.parametrize("mail", [False, True], ids=["lanes", "mail"])
@pytest.mark.parametrize("who", [1, 0])  # 1: a second lane; 0: a lane dialed the wrong way
def test_a_lane_the_node_did_not_expect_is_dropped_and_the_session_goes_on(who: int,
                                                                           mail: bool) -> None:
    """With the mail (the lanes' sockets closed after the join) any lane dialed later is
    one the node did not expect: dropped, and no lane is watched or lost for it."""
    x = np.arange(8.0)

    def fn(comm: burncoll.Communicator) -> Any:
        comm.all_reduce(x.copy())
        if comm.peer_id == who:
            link = comm._server.link  # type: ignore[attr-defined]
            service = link._service
            other = service.nodes[1 - who]
            conn = link._io.submit(service.dialing.dial(other, time.monotonic() + 5,
                                                        lane=True)).result(10)
            time.sleep(0.3)  # the other node drops it
            link._io.submit(conn.close()).result(10)
        return comm.all_reduce(x.copy()), sorted(_lanes_of(comm).socks)

    out = _two_nodes(fn, shared_memory=mail)
    for rank in (0, 1):
        assert not isinstance(out[rank], BaseException), out
        total, lanes = out[rank]
        np.testing.assert_array_equal(total, 2 * x)
        assert lanes == ([] if mail else [1 - rank])  # (the node's own lane, or none)
