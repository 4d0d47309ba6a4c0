"""Run a function on D real peer threads of one node and collect results or errors."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import burncoll


def run_peers(
    config: burncoll.CollectiveConfig,
    fn: Callable[[burncoll.Communicator, int], Any],
    peer_ids: list[int] | None = None,
    join_timeout: float = 60.0,
) -> list[Any]:
    """Register ``config.num_devices`` peers in threads, run ``fn(comm, i)`` on each, finish.

    Returns each peer's result, or the exception it raised, in local index order.
    """
    d = config.num_devices
    ids = peer_ids if peer_ids is not None else list(range(d))
    out: list[Any] = [None] * d

    def worker(i: int) -> None:
        try:
            comm = burncoll.register(ids[i], i, config)
        except Exception as exc:
            out[i] = exc
            return
        try:
            out[i] = fn(comm, i)
        except Exception as exc:
            out[i] = exc
        finally:
            with contextlib.suppress(burncoll.CollectiveError):
                comm.finish()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a peer thread hung"
    return out
