"""A calling thread waits for its exchange frames itself (performance issue, round two, item 1).

The real mailbox, frames through the real wire encoding: a :class:`Watch` gets frames stored
before it began and frames that come after, one per key, only once every check has passed;
a failure of the session, or a frame that breaks the operation's registration, wakes it with
the error instead; ``unwatch`` leaves later frames to ``get``. That node processes take this
path over real sockets, with NumPy-checked results, is tested in ``test_exchange.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest

from burncoll.errors import CollectiveTimeout, MismatchError, ProtocolError
from burncoll.node.mailbox import Mailbox, Receives
from burncoll.node.watch import Watch
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.wire import DataHeader, Frame, decode, encode_data_header

SEQ = 3
SIZE = 16


def frame(src: int, payload: bytes = bytes(SIZE), **fields: Any) -> Frame:
    h = DataHeader(
        session=1,
        seq=SEQ,
        op_kind=OpKind.ALL_REDUCE,
        reduce_op=ReduceOp.SUM,
        dtype="float64",
        shape=(2,),
        root=-1,
        src=src,
        round=0,
        channel=0,
        chunk=0,
        offset=0,
        chunk_bytes=SIZE,
    )
    h = dataclasses.replace(h, **fields)
    return decode(encode_data_header(h, len(payload)) + payload)


def keys(*srcs: int) -> list[tuple[int, int, int, int, int]]:
    return [(SEQ, 0, 0, src, 0) for src in srcs]


def started(mailbox: Mailbox, *srcs: int) -> None:
    mailbox.expect(lambda h: None, Receives(SEQ, 0, dict.fromkeys(keys(*srcs), SIZE)))


def test_a_watch_takes_frames_held_before_it_began_and_those_after() -> None:
    mailbox = Mailbox()
    early = frame(1, bytes(range(SIZE)))
    assert mailbox.put(early)  # held: the operation has not started here
    started(mailbox, 1, 2)
    watch = Watch(keys(1, 2))
    mailbox.watch(watch)
    assert not watch.done.is_set() and list(watch.frames) == keys(1)
    late = frame(2, bytes(range(SIZE, 2 * SIZE)))
    assert not mailbox.put(late)
    assert watch.done.is_set() and watch.error is None
    assert [bytes(watch.frames[k].payload) for k in keys(1, 2)] == [
        bytes(range(SIZE)),
        bytes(range(SIZE, 2 * SIZE)),
    ]


def test_a_failure_wakes_a_waiting_thread_with_the_error() -> None:
    mailbox = Mailbox()
    started(mailbox, 1)
    watch = Watch(keys(1))
    mailbox.watch(watch)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(watch.done.wait(10)))
    waiter.start()
    error = CollectiveTimeout("node 1 is late")
    mailbox.fail(error)
    waiter.join(10)
    assert woke == [True] and watch.error is error and not watch.frames


def test_a_watch_begun_after_the_failure_is_woken_at_once() -> None:
    mailbox = Mailbox()
    error = MismatchError("another call")
    mailbox.fail(error)
    watch = Watch(keys(1))
    mailbox.watch(watch)
    assert watch.done.is_set() and watch.error is error


@pytest.mark.parametrize(
    "wrong",
    [
        {"chunk_bytes": SIZE * 2},  # a size the operation does not receive
        {"src": 5},  # a sender it does not receive from
    ],
)
def test_a_frame_off_the_registration_never_reaches_the_watch(wrong: dict[str, Any]) -> None:
    mailbox = Mailbox()
    started(mailbox, 1)
    watch = Watch(keys(1))
    mailbox.watch(watch)
    payload = bytes(wrong.get("chunk_bytes", SIZE))
    with pytest.raises(ProtocolError):
        mailbox.put(frame(**{"src": 1, "payload": payload, **wrong}))
    assert not watch.done.is_set() and not watch.frames


def test_a_mismatched_call_fails_the_watch_with_the_mismatch() -> None:
    mailbox = Mailbox()
    mismatch = MismatchError("node 1 called all_reduce(float32[4])")
    mailbox.expect(
        lambda h: mismatch if h.dtype != "float64" else None,
        Receives(SEQ, 0, dict.fromkeys(keys(1), SIZE)),
    )
    watch = Watch(keys(1))
    mailbox.watch(watch)
    mailbox.put(frame(1, dtype="float32", shape=(4,)))
    assert watch.done.is_set() and watch.error is mismatch and not watch.frames


def test_after_unwatch_frames_wait_for_get() -> None:
    mailbox = Mailbox()
    started(mailbox, 1)
    watch = Watch(keys(1))
    mailbox.watch(watch)
    mailbox.unwatch(watch)
    mailbox.put(frame(1, bytes(range(SIZE))))
    assert not watch.frames

    async def get() -> Frame:
        return await mailbox.get(keys(1)[0], mailbox.clock() + 5, lambda: AssertionError())

    assert bytes(asyncio.run(get()).payload) == bytes(range(SIZE))


def _receives(*srcs: int) -> Receives:
    return Receives(SEQ, 0, dict.fromkeys(keys(*srcs), SIZE))


def test_a_calling_thread_starts_its_lane_itself_when_nothing_needs_the_loop() -> None:
    mailbox = Mailbox()
    mailbox.put(frame(1, bytes(range(SIZE))))  # held, and right
    watch = Watch(keys(1, 2))
    assert mailbox.start_watched(lambda h: None, _receives(1, 2), watch)
    assert mailbox.running and mailbox.budget.held == (0, 0)  # started: no longer held
    assert list(watch.frames) == keys(1) and not watch.done.is_set()
    mailbox.put(frame(2))
    assert watch.done.is_set() and watch.error is None
    mailbox.done(SEQ)
    assert not mailbox.running


@pytest.mark.parametrize("held", ["mismatch", "wrong-size", "failed"])
def test_what_the_loop_must_report_is_left_to_it(held: str) -> None:
    """A held frame that fails a check, or a failed session: the calling thread starts
    nothing (the event loop starts the lane and reports the failure to every peer)."""
    mailbox = Mailbox()
    mismatch = MismatchError("node 1 called all_reduce(float32[4])")
    if held == "mismatch":
        mailbox.put(frame(1, dtype="float32", shape=(4,)))
    elif held == "wrong-size":
        mailbox.put(frame(1, bytes(SIZE * 2), chunk_bytes=SIZE * 2))
    else:
        mailbox.fail(CollectiveTimeout("late"))
    watch = Watch(keys(1))
    check = lambda h: mismatch if h.dtype != "float64" else None  # noqa: E731
    assert not mailbox.start_watched(check, _receives(1), watch)
    assert not mailbox.running and not watch.frames and not watch.done.is_set()
