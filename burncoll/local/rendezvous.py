"""The :class:`Rendezvous` of a node's peer threads, and failure handling.

Theory of operation
-------------------
Every peer numbers its calls 0, 1, 2, ... (the operation's *sequence number*). A call
*arrives*: it is stored in the :class:`OpState` of its sequence number and the peer waits until
all local peers have arrived. The last to arrive compares the calls (a difference is a
:class:`~burncoll.MismatchError` for everyone) and *prepares* the operation: it chooses the
operation's plan and builds what the peers share (:mod:`burncoll.local.plans`); then every peer
thread runs its part of the prepared operation, meeting the others at a barrier between rounds.

Every wait ends by the operation's deadline (arrival + ``config.timeout``). Any failure -- a
timeout, a mismatch, an error from another node -- *aborts* the rendezvous: the error is raised on
every peer taking part in the operation, the barrier is broken so no thread stays blocked,
other nodes are told, and every later call raises :class:`~burncoll.CollectiveAborted` at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from burncoll.backends.base import Array, Backend, Device
from burncoll.config import CollectiveConfig
from burncoll.errors import (
    CollectiveAborted,
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    UsageError,
)
from burncoll.levels import GlobalLink
from burncoll.local.calls import Call, describe_calls, find_mismatch
from burncoll.local.post import PostOffice
from burncoll.local.world import World

__all__ = ["SYNC_GRACE", "OpState", "Plan", "Prepared", "Rendezvous"]

#: Extra seconds a local peer waits at a barrier in a multi-node collective.
SYNC_GRACE = 1.5


class Prepared(Protocol):
    """One operation, prepared: its plan and what the peers share (buffers, results)."""

    def run(self, index: int, deadline: float) -> Array | None:
        """Local peer ``index``'s part of the operation (in its own thread); its result."""
        ...


class Plan(Protocol):
    """An operation's plan (:mod:`burncoll.local.plans`), kept per signature."""

    def prepare(self, rv: Rendezvous, state: OpState) -> Prepared:
        """``state``'s operation prepared (by the last local peer to arrive)."""
        ...


@dataclass
class OpState:
    """Everything the local peers share for one operation."""

    seq: int
    calls: list[Call | None]
    arrived: int = 0
    left: int = 0
    ready: bool = False
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)
    #: Where each peer is, for timeout messages.
    progress: list[str] = field(default_factory=list)
    #: Set by the last peer to arrive, before the others are let through.
    prepared: Prepared | None = None
    #: With several local peers: held until the operation is ready or the node failed, then
    #: released once (:meth:`Rendezvous._open`); each waiting peer takes it and gives it back,
    #: which wakes the next one without a shared lock to take again.
    latch: threading.Lock | None = None
    opened: bool = False

    def complete_calls(self) -> list[Call]:
        return list(filter(None, self.calls))  # (a call, a non-empty tuple, is true)


def copy_error(error: BaseException) -> BaseException:
    """A fresh exception of the same type and message (one per raising thread)."""
    try:
        fresh = type(error)(*error.args)
    except Exception:  # pragma: no cover - exotic constructors
        return error
    fresh.__cause__ = error.__cause__
    return fresh


class Rendezvous:
    """The peers of one node, where they meet for every operation, and the node's failure
    state."""

    def __init__(
        self,
        backend: Backend,
        peer_ids: Sequence[int],
        devices: Sequence[Device],
        config: CollectiveConfig,
        link: GlobalLink | None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.link = link
        self.peer_ids = tuple(peer_ids)
        self.devices = tuple(devices)
        self.size = len(self.peer_ids)
        self.index_of = {pid: i for i, pid in enumerate(self.peer_ids)}
        self.world = World.of(self.peer_ids, link)
        #: Every peer id of the collective (a peer's rank is its index here), and their count.
        self.world_peer_ids = self.world.all_peer_ids
        self.world_size = len(self.world_peer_ids)
        self.rank_of = {pid: r for r, pid in enumerate(self.world_peer_ids)}
        #: Guards the state below; hot paths take the lock itself (a ``with`` on the
        #: condition is a Python call more), waits and notifications use the condition.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._ops: dict[int, OpState] = {}
        self._next_seq = [0] * self.size
        self._barrier = threading.Barrier(self.size)
        self._failure: BaseException | None = None
        self._finished: set[int] = set()
        self._closed = False
        #: Peers inside run() right now (an aborted node is closed only once they are out).
        self._active = 0
        #: Point-to-point messages between this node's peers (a timeout there fails all).
        self.post = PostOffice(self.fail)
        #: The plans of the operations seen here, by signature (``plans.choose.prepare``).
        self.plans: dict[tuple[object, ...], Plan] = {}

    # -- state ------------------------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def check_usable(self, index: int) -> None:
        """Raise at once if the collective is aborted or this peer has finished."""
        if index in self._finished:
            raise UsageError(
                f"peer {self.peer_ids[index]} called an operation after finish(); "
                "register it again to start a new collective"
            )
        failure = self._failure
        if failure is not None:
            raise CollectiveAborted(
                f"the collective was aborted by an earlier failure "
                f"({type(failure).__name__}: {failure}); call burncoll.register(...) again "
                "on every peer to start over"
            ) from failure

    # -- one operation ----------------------------------------------------------------------
    def run(
        self,
        index: int,
        call: Call,
        prepare: Callable[[Rendezvous, OpState], Prepared],
    ) -> Array | None:
        """Arrive with ``call``, then run this peer's part of the operation as the last peer
        to arrive prepared it with ``prepare``; the result or an error."""
        started = time.monotonic()  # (usable? checked on arrival)
        deadline = started + self.config.timeout
        if self.size == 1:
            return self._run_alone(call, started, deadline, prepare)
        with self._lock:
            self._active += 1
        try:
            return self._run(index, call, started, deadline, prepare)
        finally:
            with self._lock:
                self._active -= 1
                if self._closed:  # finish() waits for the peers still inside
                    self._cond.notify_all()

    def _run(
        self,
        index: int,
        call: Call,
        started: float,
        deadline: float,
        prepare: Callable[[Rendezvous, OpState], Prepared],
    ) -> Array | None:
        state = self._arrive(index, call, started, deadline, prepare)
        try:
            return self._ran(call, state, state.prepared, index, deadline)
        finally:
            self._leave(state)

    def _run_alone(self, call: Call, started: float, deadline: float,
                   prepare: Callable[[Rendezvous, OpState], Prepared]) -> Array | None:
        """:meth:`run` for a node with one local peer, which always arrives last: no other
        peer to compare its call with, wait for or notify, and the lock taken twice (usable:
        the caller has just asked, and no other local peer can have failed the node since)."""
        with self._lock:
            seq = self._next_seq[0]
            self._next_seq[0] = seq + 1
            state = OpState(seq, [call], arrived=1, ready=True, started=started,
                            progress=["arrived"])
            self._ops[seq] = state
            self._active += 1
        try:  # (state.prepared stays None: nobody waits for it, and it would hold state)
            prepared = self._prepare(call, state, prepare)
            if state.error is not None:
                self.fail(state.error)
                raise copy_error(state.error)
            return self._ran(call, state, prepared, 0, deadline)
        finally:
            with self._lock:
                state.left = 1
                self._ops.pop(seq, None)
                self._active -= 1
                if self._closed:  # finish() waits for the peers still inside
                    self._cond.notify_all()

    def _prepare(self, call: Call, state: OpState,
                 prepare: Callable[[Rendezvous, OpState], Prepared]) -> Prepared | None:
        """``prepare(self, state)``, or ``None`` with ``state.error`` set to why it failed."""
        try:
            return prepare(self, state)
        except CollectiveError as exc:
            state.error = exc
        except Exception as exc:  # never leave the other peers waiting for it
            state.error = CollectiveError(
                f"{call.kind.label} #{state.seq} could not be prepared on peer "
                f"{call.peer_id}: {type(exc).__name__}: {exc}")
        return None

    def _ran(self, call: Call, state: OpState, prepared: Prepared | None, index: int,
             deadline: float) -> Array | None:
        """Peer ``index``'s part of ``state``'s ``prepared`` operation; whatever stops it
        stops the other peers too, at once."""
        try:
            if prepared is None:  # pragma: no cover - prepared states only come here
                raise RuntimeError("operation was not prepared")
            return prepared.run(index, deadline)
        except BaseException as exc:
            self.fail(exc if isinstance(exc, CollectiveError) else CollectiveError(
                f"{call.kind.label} #{state.seq} failed on peer {call.peer_id}: "
                f"{type(exc).__name__}: {exc}"))
            raise

    def _arrive(self, index: int, call: Call, started: float, deadline: float,
                prepare: Callable[[Rendezvous, OpState], Prepared]) -> OpState:
        with self._lock:
            self.check_usable(index)
            seq = self._next_seq[index]
            self._next_seq[index] += 1
            state = self._ops.get(seq)
            if state is None:
                latch = threading.Lock()
                latch.acquire()
                state = OpState(seq, [None] * self.size, progress=["arrived"] * self.size,
                                latch=latch)
                self._ops[seq] = state
            state.calls[index] = call
            state.arrived += 1
            last = state.arrived == self.size
            if last:
                mismatch = find_mismatch(state.complete_calls())
                if mismatch is not None:
                    state.error = MismatchError(f"{call.kind.label} #{seq}: {mismatch}")
            early = self._finished_before(state) if self._finished else None
        if early:  # a local peer finished without calling it: it never will
            self.fail(early)
            raise copy_error(early)
        if last:
            if state.error is None:
                state.prepared = self._prepare(call, state, prepare)
            with self._lock:
                state.ready = True
                self._open(state)  # (the other local peers wait for it)
            if state.error is not None:
                self.fail(state.error)
                raise copy_error(state.error)
            return state
        return self._wait_ready(call, state, started, deadline)

    def _wait_ready(self, call: Call, state: OpState, started: float, deadline: float
                    ) -> OpState:
        """``state`` once the last peer prepared it; its error, or the node's, raised."""
        latch = state.latch
        if latch is None:  # pragma: no cover - made with the state of several peers
            raise RuntimeError("no latch to wait on")
        extended = False
        while not state.opened:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and state.arrived == self.size and not extended:
                # everyone is here; the last peer is still preparing (maybe talking to
                # other nodes, with its own deadline): wait a bounded while longer
                deadline += SYNC_GRACE
                extended = True
                continue
            if remaining <= 0:
                break
            if latch.acquire(timeout=remaining):
                latch.release()  # (the next waiting peer's turn)
        # (final once opened: error and ready are set, then the latch opened, under _lock)
        if state.ready and state.error is None:
            return state
        failure = state.error or self._failure
        if failure is None:
            failure = self._arrival_timeout(call, state, started)
            self.fail(failure)
        raise copy_error(failure)

    def _open(self, state: OpState) -> None:
        """Let the peers waiting for ``state`` through, once (with ``_lock`` held)."""
        if not state.opened and state.latch is not None:
            state.opened = True
            state.latch.release()

    def _arrival_timeout(self, call: Call, state: OpState, started: float) -> CollectiveTimeout:
        missing = [pid for pid, c in zip(self.peer_ids, state.calls, strict=True) if c is None]
        arrived = state.complete_calls()
        elapsed = time.monotonic() - started
        return CollectiveTimeout(
            f"{call.kind.label} #{state.seq} timed out after {elapsed:.1f} s "
            f"(timeout {self.config.timeout:g} s): local peer(s) {missing} never called it; "
            f"arrived: {describe_calls(arrived)}. Hint: every peer must call the same "
            "operations in the same order."
        )

    def _leave(self, state: OpState) -> None:
        with self._lock:
            state.left += 1
            if state.left == self.size:
                self._ops.pop(state.seq, None)
                state.prepared = None  # (it refers to state: freed now, not by the collector)

    def sync(self, state: OpState, index: int, deadline: float, where: str) -> None:
        """Wait until every local peer has reached the same point of the same operation."""
        state.progress[index] = f"done with {where}"
        # The grace lets a peer that is talking to other nodes report its own (better
        # explained) timeout first; it is bounded, so this wait still ends.
        remaining = deadline - time.monotonic() + (SYNC_GRACE if self.link is not None else 0.0)
        try:
            self._barrier.wait(max(remaining, 0.0))
        except threading.BrokenBarrierError:
            failure = self._failure
            if failure is None:
                late = [
                    f"peer {pid} ({state.progress[i]})"
                    for i, pid in enumerate(self.peer_ids)
                    if state.progress[i] != f"done with {where}"
                ]
                calls = state.complete_calls()
                kind = calls[0].kind.label if calls else "operation"
                failure = CollectiveTimeout(
                    f"{kind} #{state.seq} timed out (timeout {self.config.timeout:g} s) "
                    f"waiting for local peers to finish {where}: late: {', '.join(late)}"
                )
                self.fail(failure)
                failure = self._failure or failure
            raise copy_error(failure) from None

    def status(self) -> dict[str, Any]:
        """Which local peers have arrived at which operations (answers other nodes' queries)."""
        with self._cond:
            arrived = {
                str(seq): [c.peer_id for c in state.complete_calls()]
                for seq, state in self._ops.items()
            }
            return {"arrived": arrived, "next_seq": dict(zip(self.peer_ids, self._next_seq,
                                                             strict=True))}

    # -- failure ----------------------------------------------------------------------------
    def fail(self, error: BaseException, *, remote: bool = False) -> None:
        """Abort: wake and fail every waiting peer; tell other nodes unless ``remote``."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = error
            self._cond.notify_all()
            for state in self._ops.values():
                self._open(state)
        self._barrier.abort()
        self.post.fail(error)
        if self.link is not None and not remote:
            self.link.abort(error)

    def _finished_before(self, state: OpState) -> MismatchError | None:
        """The error when a peer that has finished never called ``state``'s operation (with
        ``_lock`` held): it names that peer and the peers waiting in the operation."""
        early = [pid for i, pid in enumerate(self.peer_ids)
                 if i in self._finished and self._next_seq[i] <= state.seq]
        calls = state.complete_calls()
        if not early or not calls:
            return None
        return MismatchError(
            f"{calls[0].kind.label} #{state.seq}: local peer(s) {early} called finish() "
            f"after {min(self._next_seq[self.index_of[p]] for p in early)} operation(s), "
            f"without calling it; waiting in it: {describe_calls(calls)}. Hint: every peer "
            "must call the same operations in the same order.")

    # -- finish -----------------------------------------------------------------------------
    def finish(self, index: int) -> bool:
        """Mark peer ``index`` finished; True for the peer that must close the node.

        A healthy collective waits for every local peer to finish so the node leaves the
        collective once: up to ``config.timeout``, as every other wait (a collective of
        theirs needs this peer, which has none in flight). An aborted one lets each peer go
        at once.
        """
        deadline = time.monotonic() + self.config.timeout
        with self._cond:
            if index in self._finished:
                return False
            self._finished.add(index)
            skipped = [s for seq, s in self._ops.items() if seq >= self._next_seq[index]]
            early = self._finished_before(min(skipped, key=lambda s: s.seq)) if skipped else None
        if early:  # other local peers wait in an operation this peer never called
            self.fail(early)
        with self._cond:
            self._cond.notify_all()
            while len(self._finished) < self.size and self._failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [
                        pid for i, pid in enumerate(self.peer_ids) if i not in self._finished
                    ]
                    raise CollectiveTimeout(
                        f"finish timed out after {self.config.timeout:g} s: local peer(s) "
                        f"{missing} never called finish()"
                    )
                self._cond.wait(remaining)
            if self._closed:
                return False
            self._closed = True
            # other local peers may still be failing out of an operation (telling the other
            # nodes, asking them for their status): let them, for a bounded while
            settle = time.monotonic() + SYNC_GRACE + 1.0
            while self._active > 0 and time.monotonic() < settle:
                self._cond.wait(settle - time.monotonic())
            return True
