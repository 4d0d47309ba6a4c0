"""The post office of one node's peers: point-to-point messages between its threads.

A message is a :class:`Letter`: a copy of the sent array (never the caller's array itself: the
sender may change that as soon as its send returns), and the sender's
:class:`~burncoll.work.Work`, completed once a receive took the letter. A receive posted before
its message waits as a :class:`Receipt`. Letters and receipts are matched per key ``(src peer,
dst peer, tag)`` in the order they were posted (first in, first out); a key never holds
letters and receipts at once. Handing a letter over runs the receipt's ``deliver`` outside the
post office's lock, in whichever thread matched them.

Every wait ends by its deadline: a blocking caller waits for its own work (:meth:`PostOffice.
wait`), an asynchronous one is watched by a timer (:meth:`PostOffice.watch`). A letter or
receipt still unmatched at its deadline is withdrawn and fails with the error its caller
gave, and the post office reports it (``on_timeout``: the rendezvous fails every peer with
it); :meth:`PostOffice.fail` fails everything still posted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from burncoll.backends.base import Array
from burncoll.errors import CollectiveTimeout
from burncoll.work import Work

__all__ = ["Letter", "PostKey", "PostOffice", "Receipt"]

#: ``(src peer, dst peer, tag)``: letters of one key are taken in the order posted.
PostKey = tuple[int, int, int]


@dataclass(eq=False)
class Letter:
    """A message posted and not taken yet: a copy of the sent array and the sender's work."""

    array: Array
    dtype: str
    shape: tuple[int, ...]
    sent: Work[None]


@dataclass(eq=False)
class Receipt:
    """A receive waiting for its letter. ``deliver(letter)`` completes ``received`` with the
    letter's array, or refuses it: it returns the error for the sender (``None``: taken)."""

    received: Work[Any]
    deliver: Callable[[Letter], BaseException | None]


class PostOffice:
    """Letters and receipts of one node's peers, by key; thread-safe."""

    def __init__(self, on_timeout: Callable[[BaseException], None]) -> None:
        self._lock = threading.Lock()
        self._letters: dict[PostKey, deque[Letter]] = {}
        self._receipts: dict[PostKey, deque[Receipt]] = {}
        self._error: BaseException | None = None
        self._on_timeout = on_timeout

    def post(self, key: PostKey, letter: Letter) -> None:
        """Post ``letter``: to the receipt waiting longest for ``key``, or kept for a receive."""
        with self._lock:
            receipt = self._pop(self._receipts, key) if self._error is None else None
            if receipt is None and self._error is None:
                self._letters.setdefault(key, deque()).append(letter)
            error = self._error
        if error is not None:
            letter.sent.set_exception(error)
        elif receipt is not None:
            _hand(letter, receipt)

    def collect(self, key: PostKey, receipt: Receipt) -> None:
        """Post ``receipt``: it takes the oldest letter of ``key``, or waits for one."""
        with self._lock:
            letter = self._pop(self._letters, key) if self._error is None else None
            if letter is None and self._error is None:
                self._receipts.setdefault(key, deque()).append(receipt)
            error = self._error
        if error is not None:
            receipt.received.set_exception(error)
        elif letter is not None:
            _hand(letter, receipt)

    @staticmethod
    def _pop(queues: dict[PostKey, deque[Any]], key: PostKey) -> Any:
        queue = queues.get(key)
        if not queue:
            return None
        item = queue.popleft()
        if not queue:
            del queues[key]
        return item

    # -- deadlines ----------------------------------------------------------------------------
    def withdraw(self, key: PostKey, item: Letter | Receipt, error: BaseException) -> bool:
        """At its deadline: if ``item`` is still waiting, take it back and fail it and the
        collective with ``error``; ``False`` when it was matched (or failed) already."""
        queues: dict[PostKey, deque[Any]] = (
            self._letters if isinstance(item, Letter) else self._receipts)
        with self._lock:
            queue = queues.get(key)
            if queue is None or item not in queue:
                return False
            queue.remove(item)
            if not queue:
                del queues[key]
        (item.sent if isinstance(item, Letter) else item.received).set_exception(error)
        self._on_timeout(error)
        return True

    def wait(self, key: PostKey, item: Letter | Receipt, work: Work[Any], deadline: float,
             error: Callable[[], BaseException]) -> Any:
        """From the caller's thread: ``work``'s result, or ``error()`` once ``deadline``
        passed with ``item`` still waiting."""
        try:
            return work.wait(max(deadline - time.monotonic(), 0.0))
        except CollectiveTimeout:
            if work.is_completed():  # the operation's own timeout (or the collective's)
                raise
        self.withdraw(key, item, error())
        return work.wait()  # done now: withdrawn, or being handed over (a moment)

    def watch(self, key: PostKey, item: Letter | Receipt, work: Work[Any], deadline: float,
              error: Callable[[], BaseException]) -> None:
        """Withdraw ``item`` at ``deadline`` unless ``work`` is done by then (a timer)."""
        timer = threading.Timer(max(deadline - time.monotonic(), 0.0),
                                lambda: self.withdraw(key, item, error()))
        timer.daemon = True
        work.add_done_callback(lambda _: timer.cancel())
        if not work.is_completed():
            timer.start()

    # -- failure ------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """The collective failed: every letter and receipt still posted fails with ``error``,
        and so does everything posted from now on."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            letters = [x for q in self._letters.values() for x in q]
            receipts = [x for q in self._receipts.values() for x in q]
            self._letters.clear()
            self._receipts.clear()
        for letter in letters:
            letter.sent.set_exception(error)
        for receipt in receipts:
            receipt.received.set_exception(error)


def _hand(letter: Letter, receipt: Receipt) -> None:
    """Give ``letter`` to ``receipt``; the sender's work completes after the receiver's."""
    try:
        refused = receipt.deliver(letter)
    except Exception as exc:  # a receiver's own failure (a device copy): both hear of it
        receipt.received.set_exception(exc)
        refused = exc
    if refused is None:
        letter.sent.set_result(None)
    else:
        letter.sent.set_exception(refused)
