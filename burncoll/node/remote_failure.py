"""Another node's failure, applied here once the operations it had finished are done here too.

A node that fails the session in its operation ``N`` has finished every operation before
``N``: each of its local peers called a later one, so everything it sent for them has left
(its sends returned before it went on). Its abort may still overtake those messages -- it
travels on the member connection, the data on a caller socket or another connection -- and
failing this node's operations before ``N`` at once would fail an operation that every other
node completed, with the error of a later one (an asynchronous operation's ``Work`` raised
the mismatch of the operation issued after it). So the abort carries ``N``
(:attr:`~burncoll.node.member_messages.Abort.done_before`), and this node holds the failure
while an operation numbered below ``N`` is in flight here, for :data:`HOLD_SECONDS` at most
(or the timeout, if shorter); then every waiter fails with it, as at once before. A node
lost meanwhile does not cut the hold short (the failing node leaving is one): the held
failure, which came first, is the one raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

__all__ = [
    "HOLD_POLL_SECONDS", "HOLD_SECONDS", "fail_when_done", "finished_below", "in_flight_before",
]

#: How often a held failure looks whether the operations it waits for are done.
HOLD_POLL_SECONDS = 0.005
#: Most seconds a failure is held: the operations it waits for have all their data on its
#: way, and only receive and reduce it; one still running after that waits for something
#: else (a node lost meanwhile), which the held failure then ends.
HOLD_SECONDS = 5.0


def finished_below(status: Mapping[str, object]) -> int | None:
    """The operation number below which every local peer of this node has finished every
    operation, from its local level's status report; ``None`` without one."""
    next_seq = status.get("next_seq")
    if not isinstance(next_seq, Mapping) or not next_seq:
        return None
    return max(min(int(seq) for seq in next_seq.values()) - 1, 0)


def in_flight_before(status: Mapping[str, object], seq: int) -> bool:
    """Whether an operation numbered below ``seq`` is in flight on this node (a local peer
    arrived at it and not every one has left it)."""
    arrived = status.get("arrived")
    return isinstance(arrived, Mapping) and any(int(s) < seq for s in arrived)


async def fail_when_done(fail: Callable[[], None], status: Callable[[], Mapping[str, object]],
                         seq: int, timeout: float) -> None:
    """Call ``fail()`` once no operation numbered below ``seq`` is in flight here, or after
    :data:`HOLD_SECONDS` (``timeout``, if shorter)."""
    deadline = time.monotonic() + min(timeout, HOLD_SECONDS)
    while in_flight_before(status(), seq) and time.monotonic() < deadline:
        await asyncio.sleep(HOLD_POLL_SECONDS)
    fail()
