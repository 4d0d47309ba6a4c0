"""The held budget a data service's mailbox and inbox share (issue 30, item 4).

The budget alone: items and bytes count together against their limits, a paused reader waits
for room or for its own item to stop being held, and a release from a calling thread wakes it
on its loop. A real mailbox and inbox sharing one budget: what one holds crowds the other,
and each paused reader still resumes once its own frame's operation starts or its own message
is received. Real sockets between three nodes: a broadcast root running ahead fills node 0's
budget, yet node 0 receives one message after another from a third node before it starts
the broadcast (a reader that waited for room alone would stall it until the timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np

from burncoll.errors import CollectiveTimeout
from burncoll.node.data_service import DataService
from burncoll.node.held import HELD_BYTES, HELD_ITEMS, HeldBudget
from burncoll.node.mailbox import Mailbox, Receives
from burncoll.node.membership import NodeInfo
from burncoll.node.p2p_outbox import message_parts
from burncoll.protocol.wire import encode_data_header
from burncoll.transport import get_transport
from tests.node.test_inbox import inbox, parts_of
from tests.node.test_part_checks import SEQ, _close, frame, header, no_check

PATIENCE = 5.0  # seconds a test waits for what must come (never reached when it passes)


def test_items_and_bytes_count_together_against_their_limits() -> None:
    assert (HELD_ITEMS, HELD_BYTES) == (4096, 64 << 20)  # what the docs promise
    budget = HeldBudget(items=3, nbytes=100)
    budget.hold(2, 60)
    assert budget.held == (2, 60) and not budget.crowded
    budget.hold(1, 0)  # an empty item counts as an item
    assert budget.crowded
    budget.release(1, 0)
    budget.hold(1, 40)  # the bytes reach the limit
    assert budget.held == (3, 100) and budget.crowded
    budget.release(3, 100)
    assert budget.held == (0, 0) and not budget.crowded


def test_a_paused_reader_waits_for_room_or_for_its_own_item() -> None:
    budget = HeldBudget(items=2, nbytes=1 << 20)
    mine = {"held": True}

    async def run() -> list[bool]:
        await asyncio.wait_for(budget.drained(lambda: True), PATIENCE)  # room: at once
        budget.hold(2, 8)
        waiting = asyncio.ensure_future(budget.drained(lambda: mine["held"]))
        await asyncio.sleep(0.02)
        paused = [not waiting.done()]
        budget.release(0, 0)  # a release that frees neither room nor this reader's item
        await asyncio.sleep(0.02)
        paused.append(not waiting.done())
        mine["held"] = False  # its item is taken (still crowded by the other one)
        budget.release(0, 0)
        await asyncio.wait_for(waiting, PATIENCE)
        paused.append(budget.crowded)
        waiting = asyncio.ensure_future(budget.drained(lambda: True))
        await asyncio.sleep(0.02)
        paused.append(not waiting.done())
        budget.release(1, 4)  # room
        await asyncio.wait_for(waiting, PATIENCE)
        return paused

    assert asyncio.run(run()) == [True, True, True, True]


def test_a_release_on_another_thread_wakes_a_paused_reader() -> None:
    """A calling thread that starts its exchange releases that lane's frames off the loop."""
    budget = HeldBudget(items=1, nbytes=1 << 20)
    budget.hold(1, 8)

    async def run() -> None:
        waiting = asyncio.ensure_future(budget.drained(lambda: True))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        releaser = threading.Thread(target=budget.release, args=(1, 8))
        releaser.start()
        await asyncio.wait_for(waiting, PATIENCE)
        releaser.join()

    asyncio.run(run())
    assert budget.held == (0, 0)


def test_a_mailbox_and_an_inbox_share_one_budget() -> None:
    """Messages no recv took fill the budget; a frame of an operation not started crowds it,
    and its reader resumes when the operation starts, though the messages still fill it; a
    message held past the budget resumes its reader when a recv takes it."""
    budget = HeldBudget(items=3, nbytes=1 << 20)
    mailbox, box = Mailbox(budget=budget), inbox(budget=budget)
    for seq in range(2):
        (message,) = parts_of(np.full(2, float(seq)), seq=seq)
        assert box.put(message, 1)
    early = frame(8, seq=SEQ + 1, chunk_bytes=8)
    assert mailbox.put(early) and budget.crowded and budget.held == (3, 40)
    (late,) = parts_of(np.full(2, 2.0), seq=2)
    assert box.put(late, 1) and budget.held == (4, 56)

    async def run() -> None:
        frames = asyncio.ensure_future(budget.drained(lambda: mailbox.holds(early.header)))
        messages = asyncio.ensure_future(budget.drained(lambda: box.holds(late.header)))
        await asyncio.sleep(0.02)
        assert not frames.done() and not messages.done()
        mailbox.expect(no_check, Receives(SEQ + 1, 0, {(SEQ + 1, 0, 0, 1, 0): 8}))
        await asyncio.wait_for(frames, PATIENCE)
        assert budget.crowded and not messages.done()  # three messages: still crowded
        for _ in range(3):
            await box.take((2, 1, 5), time.monotonic() + PATIENCE, lambda: TimeoutError())
        await asyncio.wait_for(messages, PATIENCE)

    asyncio.run(run())
    assert budget.held == (0, 0)


def test_a_failure_gives_back_what_each_held() -> None:
    budget = HeldBudget()
    mailbox, box = Mailbox(budget=budget), inbox(budget=budget)
    mailbox.put(frame(8, seq=SEQ + 1, chunk_bytes=8))
    (message,) = parts_of(np.zeros(3))
    box.put(message, 1)
    assert budget.held == (2, 32)
    mailbox.fail(RuntimeError("over"))
    box.fail(RuntimeError("over"))
    assert budget.held == (0, 0)


async def _three() -> list[DataService]:
    """Three data services of one session on 127.0.0.1 (tcp), connected; node i hosts rank i."""
    services = [DataService(get_transport("tcp"), "127.0.0.1", 0, None, PATIENCE)
                for _ in range(3)]
    for s in services:
        await s.start()
    nodes = [NodeInfo(i, "127.0.0.1", s.port, (i,)) for i, s in enumerate(services)]
    for i, s in enumerate(services):
        s.set_session(77, i, nodes, secret="ab" * 32)
    deadline = time.monotonic() + PATIENCE
    await asyncio.gather(*(s.connect_all(deadline) for s in services))
    return services


def test_a_root_running_ahead_does_not_stall_messages_from_another_node() -> None:
    """Node 2 sends 16 parts of an operation node 0 has not started (a budget of 4 parts):
    node 0's budget is full. Node 1 then sends 3 messages that node 0 receives one by one
    before it starts the operation; then it starts it and gets every part, in order."""
    part, parts, seq, tag = 64 << 10, 16, 9, 3
    key = (1, 0, tag)  # rank 1 (node 1) to rank 0 (node 0)

    async def run() -> tuple[list[float], list[int]]:
        a, b, c = await _three()
        a.mailbox.budget.bytes = 4 * part
        try:
            h = header(session=77, seq=seq, src=2, chunk_bytes=parts * part,
                       shape=(parts * part // 8,))
            for i in range(parts):
                await c.send(0, [encode_data_header(dataclasses.replace(h, offset=i * part),
                                                    part), bytes(part)])
            while not a.mailbox.budget.crowded:
                await asyncio.sleep(0.01)
            for m in range(3):
                for frame_parts in message_parts(77, 1, key, m, np.full(4, float(m))):
                    await b.send(0, frame_parts)
            got = []
            for _ in range(3):
                message = await a.inbox.take(key, time.monotonic() + PATIENCE,
                                             lambda: CollectiveTimeout("no message"))
                got.append(float(message.array()[0]))
            chunk = (seq, 0, 0, 2, 0)
            a.mailbox.expect(no_check, Receives(seq, 0, {chunk: parts * part}, part_bytes=part))
            offsets = []
            for _ in range(parts):
                f = await a.mailbox.get(chunk, time.monotonic() + PATIENCE, TimeoutError)
                assert f.header is not None
                offsets.append(f.header.offset)
            assert a.mailbox.error is None
            return got, offsets
        finally:
            await _close(a, b, c)

    got, offsets = asyncio.run(run())
    assert got == [0.0, 1.0, 2.0]
    assert offsets == [i * part for i in range(parts)]
