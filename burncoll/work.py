"""Asynchronous operations: the :class:`Work` handle and the queue that runs them in order.

``comm.all_reduce(x, async_op=True)`` (torch's spelling; every collective takes it) returns a
:class:`Work` at once; the operation runs on the communicator's worker thread
(:class:`OpQueue`), in the order the operations were issued, and several may be in flight. A
blocking call issued while earlier asynchronous ones are still in flight waits until they are
done, then runs in the caller's thread, so a peer's operations always reach the collective in
program order -- the order every peer must agree on. Errors surface at :meth:`Work.wait`; the
operation's own deadline (``config.timeout``, counted from when the operation starts) still
applies, so a wait without a timeout ends too.

``isend`` / ``irecv`` also return a :class:`Work`, completed by the message's arrival (or its
receipt) rather than by the queue: point-to-point operations never wait behind collectives.

Threads. The worker is started when an operation is queued and ends once the queue has been
empty for :data:`LINGER_SECONDS` (so the operations of a training step, issued one after the
other, reuse one thread), or at once when a blocking call (``finish`` is one) runs: once it
returns, the worker has ended, and a communicator left idle holds no thread. Done callbacks
(:meth:`Work.add_done_callback`) run on the worker thread: they must not block on the same
communicator (a blocking call or a ``wait`` on a later operation from there raises
:class:`~burncoll.UsageError` instead of deadlocking).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from burncoll.errors import CollectiveTimeout, UsageError

__all__ = ["LINGER_SECONDS", "OpQueue", "Work", "when_all"]

T = TypeVar("T")

#: Seconds an idle worker waits for the next operation before its thread ends.
LINGER_SECONDS = 1.0


class Work(Generic[T]):
    """The handle of an operation in flight (``torch.distributed.Work``, MPI's ``Request``).

    :meth:`wait` blocks until the operation is done and returns its result (``None`` for
    operations without one), or raises its error; :meth:`is_completed` never blocks. A Work
    completes once; every ``wait`` after that returns the same result (or raises the same
    error).
    """

    def __init__(self, label: str) -> None:
        #: What the operation is, for error messages (``"all_reduce"``).
        self.label = label
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        #: The queue running the operation (a wait from its worker thread would deadlock).
        self._queue: OpQueue | None = None

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        else:
            state = "failed" if self._future.exception() is not None else "completed"
        return f"Work({self.label}, {state})"

    # -- completion (by whoever runs the operation) ---------------------------------------
    def set_result(self, value: T) -> None:
        """Complete the operation with ``value`` (once; later calls are ignored)."""
        # completed already (a race between two completers): the first one wins
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self._future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        """Fail the operation with ``error`` (once; later calls are ignored)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self._future.set_exception(error)

    def add_done_callback(self, fn: Callable[[Work[T]], None]) -> None:
        """Call ``fn(self)`` once the operation is done (at once, here, if it is).

        ``fn`` runs in the thread that completes the operation (a communicator's worker);
        it should be quick and must not block on that communicator. An error it raises is
        logged (``concurrent.futures``' logger) and does not reach the operation.
        """
        self._future.add_done_callback(lambda _: fn(self))

    # -- what a user calls ------------------------------------------------------------------
    def is_completed(self) -> bool:
        """Whether the operation is done (successfully or not); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation is done; its result, or its error raised here.

        ``timeout`` (seconds): give up waiting after it with a
        :class:`~burncoll.CollectiveTimeout` (the operation itself goes on, bounded by its
        own deadline: wait again later); ``None`` waits until the operation ends, which it
        does by ``config.timeout`` after it started at the latest. ``wait(0)`` polls.
        """
        self._await(timeout)
        return self._future.result()

    def result(self) -> T:
        """The operation's result, waiting for it if needed (``wait()``)."""
        return self.wait()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the operation ended with, ``None`` if it succeeded (waits for it, as
        :meth:`wait` does, without raising the operation's error)."""
        self._await(timeout)
        return self._future.exception()

    def _await(self, timeout: float | None) -> None:
        """Wait until done, or raise :class:`~burncoll.CollectiveTimeout` after ``timeout``."""
        seconds = _check_timeout(timeout)
        if self._future.done():
            return
        if self._queue is not None and self._queue.on_worker():
            raise UsageError(
                f"wait() on {self.label} from its communicator's worker thread (a done "
                "callback) would wait for itself; wait in the thread that issued it")
        finished, _ = concurrent.futures.wait([self._future], seconds)
        if not finished:
            raise CollectiveTimeout(
                f"{self.label} was not done after wait(timeout={timeout:g}); it is still in "
                "flight (its own deadline is config.timeout): wait again, or check that every "
                "peer issued it")


def _check_timeout(timeout: object) -> float | None:
    """``timeout`` as ``Future.result`` takes it; a :class:`UsageError` if it is no duration."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(
            timeout) or timeout < 0:
        raise UsageError(f"wait: timeout must be a non-negative number of seconds or None, "
                         f"got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def when_all(works: Sequence[Work[Any]], combine: Callable[[list[Any]], T],
             label: str) -> Work[T]:
    """A :class:`Work` done once every one of ``works`` is: ``combine(their results)``, or
    the error of the first of them (in the order given) that failed.

    ``combine`` runs in the thread that completes the last of ``works`` (at once, here, when
    they are all done already); an error it raises fails the returned Work.
    """
    done: Work[T] = Work(label)
    items = list(works)
    done._queue = next((w._queue for w in items if w._queue is not None), None)
    lock = threading.Lock()
    left = [len(items)]

    def finish() -> None:
        for work in items:
            error = work._future.exception()
            if error is not None:
                done.set_exception(error)
                return
        try:
            done.set_result(combine([work._future.result() for work in items]))
        except BaseException as exc:  # the caller sees it at wait()
            done.set_exception(exc)

    def one_done(_: Work[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            finish()

    if not items:
        finish()
    for work in items:
        work.add_done_callback(one_done)
    return done


class OpQueue:
    """One communicator's operations, run in the order issued.

    :meth:`submit` queues an operation and returns its :class:`Work`; a daemon worker thread
    runs the queue, started when something is queued and ended when the queue has been empty
    for :data:`LINGER_SECONDS` or a blocking operation is run.
    :meth:`run` runs a blocking operation in the calling thread once every operation issued
    before it is done (at once, with no hand-off between threads, when none is in flight).
    A queue is meant to be fed from one thread (the communicator's); the worker may queue
    more from a done callback.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], Work[Any]]] = deque()
        #: Operations queued or running on the worker.
        self._pending = 0
        self._worker: threading.Thread | None = None
        #: The last worker that ended (joined by :meth:`wait_idle`, so none is left behind).
        self._ended: threading.Thread | None = None
        #: Set by :meth:`wait_idle`: the idle worker ends now rather than after its linger.
        self._retire = False

    def __repr__(self) -> str:
        return f"OpQueue({self._name}, pending={self._pending})"

    def submit(self, fn: Callable[[], T], label: str) -> Work[T]:
        """Queue ``fn`` behind every operation issued before; its :class:`Work`."""
        work: Work[T] = Work(label)
        work._queue = self
        with self._cond:
            self._queue.append((fn, work))
            self._pending += 1
            if self._worker is None:
                worker = threading.Thread(target=self._drain, name=self._name, daemon=True)
                try:
                    worker.start()
                except BaseException:  # no thread to run it (resources): nothing was queued
                    self._queue.pop()
                    self._pending -= 1
                    raise
                self._worker = worker
            self._cond.notify_all()  # a worker waiting for more
        return work

    def run(self, fn: Callable[[], T], label: str) -> T:
        """Run ``fn`` in this thread after every operation issued before it; its result.

        Raises :class:`~burncoll.UsageError` on the worker thread (from a done callback),
        where waiting for the queue would wait for itself.
        """
        if self._worker is None and not self._pending:  # nothing in flight: go (only an
            return fn()  # issuing thread starts a worker, so this thread's reading is current)
        if self.on_worker():
            raise UsageError(f"{label}: a blocking operation cannot be issued from a done "
                             "callback (the communicator's worker thread); use async_op=True "
                             "there, or issue it from the communicator's own thread")
        self.wait_idle()
        return fn()

    def idle(self) -> bool:
        """Whether no operation is queued or running (every Work issued is completed)."""
        with self._cond:
            return self._pending == 0

    def on_worker(self) -> bool:
        """Whether the calling thread is this queue's worker."""
        return threading.current_thread() is self._worker

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every operation issued so far is done and the worker thread has ended
        (an idle worker is told to end at once); False if ``timeout`` seconds passed first.
        Each operation is bounded by its own deadline, so ``None`` ends too."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._worker is not None:
                if not self._pending:
                    self._retire = True  # idle, waiting for more: end now
                    self._cond.notify_all()
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            ended = self._ended
        if ended is not None:
            ended.join()  # it set self._worker = None as its last step: a short wait
        return True

    def _drain(self) -> None:
        while True:
            with self._cond:
                # idle: wait a while for the next operation (issuing one to a waiting worker
                # costs a wake-up, starting a thread costs more), then end
                end = time.monotonic() + LINGER_SECONDS
                while not self._queue and not self._retire and time.monotonic() < end:
                    self._cond.wait(end - time.monotonic())
                if not self._queue:
                    self._ended, self._worker = self._worker, None
                    self._retire = False
                    self._cond.notify_all()
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
