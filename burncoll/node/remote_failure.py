"""Another node's failure, applied here once the operations it had finished are done here too.

A node that fails the session in its operation ``N`` has finished every operation before
``N``: each of its local peers left them, so everything it sent for them has left (its sends
returned before it went on). Its abort may still overtake those messages -- it travels on
the member connection, the data on a caller socket or another connection -- and failing this
node's operations before ``N`` at once would fail an operation that every other node
completed, with the error of a later one (an asynchronous operation's ``Work`` raised the
mismatch of the operation issued after it). So the abort carries ``N``
(:attr:`~burncoll.protocol.members.Abort.done_before`), and this node holds the failure
until it has finished every operation numbered below ``N`` too (a local peer may still be
inside one, or not have called it yet: a broadcast's root finishes without the others), for
:data:`HOLD_SECONDS` at most (or the timeout, if shorter); then every waiter fails with it,
as at once before. A node lost meanwhile does not cut the hold short (the failing node
leaving is one): the held failure, which came first, is the one raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

__all__ = ["HOLD_POLL_SECONDS", "HOLD_SECONDS", "behind", "fail_when_done", "first_unfinished"]

#: How often a held failure looks whether the operations it waits for are done.
HOLD_POLL_SECONDS = 0.005
#: Most seconds a failure is held: the operations it waits for have all their data on its
#: way (only their calls, the receiving and the reducing are left); one still unfinished
#: after that waits for something else (a node lost meanwhile, a peer busy elsewhere), which
#: the held failure then ends.
HOLD_SECONDS = 5.0


def first_unfinished(status: Mapping[str, object]) -> int | None:
    """The first operation that not every local peer of this node has finished (one is
    inside it, or has not called it yet), from its local level's status report (``arrived``,
    ``next_seq``); ``None`` without one."""
    arrived, next_seq = status.get("arrived"), status.get("next_seq")
    if not isinstance(next_seq, Mapping) or not next_seq:
        return None
    inside = arrived if isinstance(arrived, Mapping) else {}
    return min(int(seq) for seq in [*inside, *next_seq.values()])


def behind(status: Mapping[str, object], seq: int) -> bool:
    """Whether this node has not finished every operation numbered below ``seq``."""
    first = first_unfinished(status)
    return first is not None and first < seq


async def fail_when_done(fail: Callable[[], None], status: Callable[[], Mapping[str, object]],
                         seq: int, timeout: float) -> None:
    """Call ``fail()`` once this node has finished every operation numbered below ``seq``,
    or after :data:`HOLD_SECONDS` (``timeout``, if shorter)."""
    deadline = time.monotonic() + min(timeout, HOLD_SECONDS)
    while behind(status(), seq) and time.monotonic() < deadline:
        await asyncio.sleep(HOLD_POLL_SECONDS)
    fail()
