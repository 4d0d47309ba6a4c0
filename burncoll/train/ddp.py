"""Data parallelism: one thread per device, each with its own registered communicator.

``ddp(devices, config).run(fn)`` starts one thread per device, registers it as a peer, calls
``fn(comm)`` and finishes the peer; ``DataParallel.fit`` is the training loop on it
(:mod:`burncoll.train.fit`). When ``fn`` raises on one thread the collective is aborted, so the
others raise :class:`~burncoll.CollectiveAborted` at once; ``run`` re-raises the first error.
Multi-node: every node runs the same code; peer ids are ``node_rank * len(devices) + i``
(:func:`node_rank`, :func:`burncoll.peer_ids`), so every node must use as many devices.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from burncoll.backends import get_backend
from burncoll.backends.base import Device
from burncoll.comm.communicator import Communicator, node_rank, register
from burncoll.config import CollectiveConfig
from burncoll.errors import CollectiveAborted, ConfigError, UsageError
from burncoll.train.fit import FitResult, GradFn, Update, fit

__all__ = ["NODE_RANK_ENV", "DataParallel", "ddp", "node_rank"]

R = TypeVar("R")

#: The environment variable holding this process's node rank (0 when unset).
NODE_RANK_ENV = "BURNCOLL_NODE_RANK"


def ddp(devices: Sequence[Device | int], config: CollectiveConfig) -> DataParallel:
    """A :class:`DataParallel` over ``devices`` (backend devices or their indices).

    ``config.num_devices`` is set to ``len(devices)`` when it differs (the devices given in
    the code win, as any argument does). Raises
    :class:`~burncoll.UsageError` for an empty or repeated device list, and
    :class:`~burncoll.ConfigError` when the node rank is not below ``config.num_nodes``.
    """
    devices = list(devices)
    if not devices:
        raise UsageError("ddp needs at least one device")
    if config.num_devices != len(devices):
        config = config.replace(num_devices=len(devices))  # the code's argument wins
    backend = get_backend(config.backend)
    indices = [d for d in devices if isinstance(d, int) and not isinstance(d, bool)]
    if indices:
        if min(indices) < 0:
            raise UsageError(f"device indices must be non-negative, got {indices}")
        available = backend.devices(max(max(indices) + 1, len(devices)))
        devices = [available[d] if isinstance(d, int) else d for d in devices]
    for i, a in enumerate(devices):
        for b in devices[:i]:
            if a == b:
                raise UsageError(f"device {a!r} is listed twice; ddp needs distinct devices")
    return DataParallel(devices, config, node_rank(config))


class DataParallel:
    """Runs one function per device, each in its own thread with its own communicator.

    Build it with :func:`ddp`. Two ``DataParallel`` with equal configs must not run at the
    same time in one process (their peers would meet in the same registration).
    """

    def __init__(self, devices: Sequence[Device], config: CollectiveConfig, rank: int) -> None:
        if config.num_devices != len(devices):
            raise UsageError(
                f"config.num_devices={config.num_devices} but {len(devices)} devices given"
            )
        nodes = config.num_nodes or 1
        if rank >= nodes:
            raise ConfigError(f"node rank {rank} ({NODE_RANK_ENV}) must be below num_nodes={nodes}")
        #: This node's devices, one peer (thread) each.
        self.devices: tuple[Device, ...] = tuple(devices)
        #: The configuration every peer registers with.
        self.config = config
        #: This node's rank (0 on a single node).
        self.node_rank = rank

    def __repr__(self) -> str:
        return (f"DataParallel(devices={list(self.devices)!r}, node_rank={self.node_rank}, "
                f"backend={self.config.backend!r}, num_nodes={self.config.num_nodes or 1})")

    @property
    def peer_ids(self) -> tuple[int, ...]:
        """The peer ids of this node's threads, in device order."""
        n = len(self.devices)
        return tuple(self.node_rank * n + i for i in range(n))

    def run(self, fn: Callable[[Communicator], R]) -> list[R]:
        """``fn(comm)`` once per device, each in its own thread; the results in device order.

        Each thread registers its peer, calls ``fn`` and finishes the peer (also on failure).
        If any thread raises, the collective is aborted so the others are released at once;
        every thread is joined (waiting at most ``config.timeout`` for threads busy outside a
        collective), and the first error raised is re-raised here, with its traceback. An
        interrupt (Ctrl-C) of the calling thread aborts the collective the same way.
        """
        state = _RunState()
        results: list[Any] = [None] * len(self.devices)
        threads = [
            threading.Thread(target=self._worker, args=(i, fn, results, state),
                             name=f"burncoll-ddp-peer-{pid}", daemon=True)
            for i, pid in enumerate(self.peer_ids)
        ]
        for thread in threads:
            thread.start()
        try:
            state.wait_done(len(threads), None)
        except BaseException as exc:  # an interrupt of the calling thread: release everyone
            state.record(CollectiveAborted(f"DataParallel.run interrupted: {exc!r}"), None)
            state.wait_done(len(threads), time.monotonic() + self.config.timeout)
            raise
        for thread in threads:
            thread.join(timeout=1.0)
        error = state.first_error
        if error is not None:
            alive = [t.name for t in threads if t.is_alive()]
            if alive:
                error.add_note(
                    f"burncoll: thread(s) {alive} were still busy outside any collective "
                    f"{self.config.timeout:g} s after the failure; they will stop at their "
                    "next collective call"
                )
            raise error
        return results

    def _worker(self, index: int, fn: Callable[[Communicator], R], results: list[Any],
                state: _RunState) -> None:
        comm: Communicator | None = None
        try:
            comm = register(self.peer_ids[index], self.devices[index], self.config)
            state.add(comm)
            results[index] = fn(comm)
        except BaseException as exc:
            state.record(exc, comm)
        finally:
            try:
                if comm is not None:
                    comm.finish()
            except BaseException as exc:
                state.record(exc, comm)
            state.thread_done()

    def fit(self, params: Any, data: Any, grad_fn: GradFn, update: Update, *, steps: int,
            batch_size: int | None = None, seed: int = 0, bucket_bytes: int | None = None,
            progress: bool = True, desc: str = "ddp",
            callback: Callable[[Communicator, int, Any], None] | None = None,
            checkpoint_dir: str | os.PathLike[str] | None = None,
            checkpoint_every: int | None = None) -> FitResult:
        """Train with data parallelism; see :func:`burncoll.train.fit.fit` for the contract
        (``checkpoint_dir`` / ``checkpoint_every``: checkpoint and resume after a restart).

        Overlap, as DDP's: a ``grad_fn`` returning ``(loss, iterator of (key, grad))``, its
        backward yielding layer by layer, gets each ``bucket_bytes`` bucket all-reduced while
        the next gradients are computed (:data:`~burncoll.train.fit.GradFn`)."""
        return fit(self, params, data, grad_fn, update, steps=steps, batch_size=batch_size,
                   seed=seed, bucket_bytes=bucket_bytes, progress=progress, desc=desc,
                   callback=callback, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every)


class _RunState:
    """What the threads of one ``run`` share: their communicators and the first error."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._comms: list[Communicator] = []
        self._done = 0
        self.first_error: BaseException | None = None
        self._abort: BaseException | None = None

    def add(self, comm: Communicator) -> None:
        """Track ``comm``; abort it at once if the run already failed."""
        with self._cond:
            self._comms.append(comm)
            abort = self._abort
        if abort is not None:
            comm._server.fail(abort)
            raise CollectiveAborted("another peer of this run failed first") from abort

    def record(self, error: BaseException, comm: Communicator | None) -> None:
        """Keep ``error`` if it is the first, and abort the collective for every peer."""
        with self._cond:
            if self.first_error is None:
                self.first_error = error
            if self._abort is None:
                where = f"peer {comm.peer_id}" if comm is not None else "DataParallel.run"
                self._abort = CollectiveAborted(f"{where} failed: {type(error).__name__}: {error}")
                self._abort.__cause__ = error
            abort = self._abort
            comms = list(self._comms)
            self._cond.notify_all()
        for c in comms:  # each node has one server; failing it twice is harmless
            c._server.fail(abort)

    def thread_done(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def wait_done(self, count: int, deadline: float | None) -> None:
        """Wait until ``count`` threads are done, or ``deadline`` (monotonic) passes. Once an error
        is recorded, waits at most the timeout of the failing collective more."""
        with self._cond:
            while self._done < count:
                if deadline is None and self.first_error is not None and self._comms:
                    deadline = time.monotonic() + self._comms[0].config.timeout
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return
                self._cond.wait(0.5 if timeout is None else min(timeout, 0.5))
