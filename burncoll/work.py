"""Asynchronous operations: the :class:`Work` handle and the queue that runs them in order.

``comm.all_reduce(x, async_op=True)`` (torch's spelling; every collective takes it) returns a
:class:`Work` at once; the operation runs on the communicator's worker thread
(:class:`OpQueue`), in the order the operations were issued, and several may be in flight. A
blocking call issued while earlier asynchronous ones are still queued waits its turn (it is
queued too), so a peer's operations always reach the collective in program order -- the order
every peer must agree on. Errors surface at :meth:`Work.wait`; the operation's own deadline
(``config.timeout``) still applies, so a wait without a timeout ends too.

``isend`` / ``irecv`` also return a :class:`Work`, completed by the message's arrival (or its
receipt) rather than by the queue: point-to-point operations never wait behind collectives.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from burncoll.errors import CollectiveTimeout, UsageError

__all__ = ["OpQueue", "Work"]

T = TypeVar("T")


class Work(Generic[T]):
    """The handle of an operation in flight (``torch.distributed.Work``, MPI's ``Request``).

    :meth:`wait` blocks until the operation is done and returns its result (``None`` for
    operations without one), or raises its error; :meth:`is_completed` never blocks.
    """

    def __init__(self, label: str) -> None:
        #: What the operation is, for error messages (``"all_reduce #3"``).
        self.label = label
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"Work({self.label}, {state})"

    # -- completion (by whoever runs the operation) ---------------------------------------
    def set_result(self, value: T) -> None:
        """Complete the operation with ``value`` (once; later calls are ignored)."""
        if not self._future.done():
            self._future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        """Fail the operation with ``error`` (once; later calls are ignored)."""
        if not self._future.done():
            self._future.set_exception(error)

    def add_done_callback(self, fn: Callable[[Work[T]], None]) -> None:
        """Call ``fn(self)`` once the operation is done (at once if it is)."""
        self._future.add_done_callback(lambda _: fn(self))

    # -- what a user calls ------------------------------------------------------------------
    def is_completed(self) -> bool:
        """Whether the operation is done (successfully or not); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation is done; its result, or its error raised here.

        ``timeout`` (seconds): give up waiting after it with a
        :class:`~burncoll.CollectiveTimeout` (the operation itself goes on, bounded by its
        own deadline); ``None`` waits until the operation ends, which it does by
        ``config.timeout`` at the latest.
        """
        if timeout is not None and (isinstance(timeout, bool) or timeout < 0):
            raise UsageError(f"wait: timeout must be a non-negative number of seconds or None, "
                             f"got {timeout!r}")
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeout(
                f"{self.label} was not done after wait(timeout={timeout:g}); it is still in "
                "flight (its own deadline is config.timeout): wait again, or check that every "
                "peer issued it") from None

    def result(self) -> T:
        """The operation's result, waiting for it if needed (``wait()``)."""
        return self.wait()

    def exception(self) -> BaseException | None:
        """The error the operation ended with, ``None`` if it succeeded (waits for it)."""
        return self._future.exception()


class OpQueue:
    """One communicator's operations, run in the order issued.

    :meth:`run` runs a blocking operation in the calling thread when nothing is queued (no
    hand-off between threads on the common path), else queues it behind the others and waits.
    :meth:`submit` queues an operation and returns its :class:`Work`; a daemon worker thread
    runs the queue, started when something is queued and ended when the queue is empty.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], Work[Any]]] = deque()
        #: Operations queued or running on the worker.
        self._pending = 0
        self._worker: threading.Thread | None = None

    def submit(self, fn: Callable[[], T], label: str) -> Work[T]:
        """Queue ``fn`` behind every operation issued before; its :class:`Work`."""
        work: Work[T] = Work(label)
        with self._cond:
            self._queue.append((fn, work))
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name=self._name,
                                                daemon=True)
                self._worker.start()
            self._cond.notify_all()
        return work

    def run(self, fn: Callable[[], T], label: str) -> T:
        """Run ``fn`` after every operation issued before it; its result."""
        with self._cond:
            idle = self._pending == 0
        if idle:
            return fn()
        return self.submit(fn, label).wait()

    def idle(self) -> bool:
        """Whether no operation is queued or running."""
        with self._cond:
            return self._pending == 0

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._worker = None
                    return
                fn, work = self._queue.popleft()
            try:
                work.set_result(fn())
            except BaseException as exc:  # the caller sees it at wait()
                work.set_exception(exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
