"""One asyncio event loop per node, on a daemon thread; peer threads submit work to it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from burncoll.errors import CollectiveTimeout

__all__ = ["CLEANUP_GRACE", "IoLoop"]

#: Seconds :meth:`IoLoop.run` waits, past a coroutine's deadline and a one-second guard, for
#: it to finish cleaning up and raise its own error.
CLEANUP_GRACE = 5.0

T = TypeVar("T")


class IoLoop:
    """An event loop running on its own daemon thread until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # drain what is left so transports close their sockets
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future completes with its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], deadline: float, what: str) -> T:
        """Run ``coro`` on the loop and wait for it from this (non-loop) thread.

        The coroutine enforces its own deadlines; the extra second here (and
        :data:`CLEANUP_GRACE` for one that is cleaning up) only guards against a coroutine that
        forgot to, and turns that into a :class:`CollectiveTimeout`.
        """
        future = self.submit(coro)
        try:
            return future.result(max(deadline - time.monotonic(), 0.0) + 1.0)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine itself raised a TimeoutError (CollectiveTimeout)
                raise
        # Past its deadline a failing coroutine may still be cleaning up (closing connections
        # waits up to the transport's close timeout): its own error says what went wrong, ours
        # would not, so give it a little longer before giving up on it.
        try:
            return future.result(CLEANUP_GRACE)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise
        future.cancel()
        raise CollectiveTimeout(
            f"{what} did not complete within {1.0 + CLEANUP_GRACE:g} s of its deadline"
        ) from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (idempotent)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
