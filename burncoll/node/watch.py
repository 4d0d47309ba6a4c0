"""A calling thread that waits for its frames itself, without the event loop's help.

The one-round exchange of a small all-reduce is the operation where the thread hand-offs cost
more than the work: a peer thread that asks the event loop to run a coroutine, and waits for
it, pays two wake-ups (each one a CPU to be scheduled on, which a busy host makes slow) plus
the loop's task machinery. Instead, the peer thread sends its message itself
(``DataService.send_now``), starts the operation's lane and *watches* for its frames itself,
under the mailbox's lock (:meth:`Mailbox.start_watched
<burncoll.node.mailbox.Mailbox.start_watched>`; through one loop callback, not a task, when
a held frame must be reported first), and waits on a :class:`Watch`: the loop's reader hands
each frame over as it is stored and the last one wakes the peer thread, which reduces the
arrays itself.

Every check still runs where it ran: the mailbox checks a frame against this node's call
before it reaches a watch. A failure of the session wakes the watch with the error; a watch
that times out, fails, or holds anything unexpected hands over to the event loop, which
reports it as the ordinary path does (the same errors, the same explanations).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from burncoll.node.receives import FrameKey
    from burncoll.protocol.wire import Frame

__all__ = ["Watch"]


class Watch:
    """One frame of each of ``keys``, handed over by the event loop's thread; :attr:`done`
    is set once every key has its frame, or the session failed (:attr:`error`)."""

    __slots__ = ("done", "error", "frames", "keys", "started")

    def __init__(self, keys: Sequence[FrameKey]) -> None:
        self.keys = tuple(keys)
        self.frames: dict[FrameKey, Frame] = {}
        self.error: BaseException | None = None
        #: The operation's lane was started (``Mailbox.expect``) before the watch began.
        self.started = False
        self.done = threading.Event()

    def take(self, key: FrameKey, frame: Frame) -> None:
        """The frame of ``key`` has come (under the mailbox's lock)."""
        self.frames[key] = frame
        if len(self.frames) == len(self.keys):
            self.done.set()

    def fail(self, error: BaseException) -> None:
        """The session failed, or starting it did: wake the waiting thread."""
        self.error = error
        self.done.set()
