"""Point-to-point messages of :class:`~burncoll.Communicator`: ``send``, ``recv``, ``isend``,
``irecv`` (torch.distributed's and mpi4py's names), between any two peers of the collective --
threads of one node (:mod:`burncoll.local.post`, which holds a copy of the sent array), or
peers of different nodes (DATA frames checked on arrival: :mod:`burncoll.node.inbox`).

The semantics (order per ``(src, dst, tag)``, a synchronous ``send``, ``out=`` checks,
deadlines, backpressure past the held budget) are MPI's and torch.distributed's, as
docs/operations.md ("Point-to-point messages") states them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from burncoll.backends.base import Array
from burncoll.backends.checks import check_out
from burncoll.comm.core import CommunicatorCore
from burncoll.dtypes import dtype_name
from burncoll.errors import (
    CollectiveAborted,
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    UsageError,
)
from burncoll.ioloop import CLEANUP_GRACE
from burncoll.levels import MAX_TAG, HostArray
from burncoll.local.post import Letter, Receipt
from burncoll.protocol.wire import MAX_NDIM
from burncoll.work import Work

__all__ = ["PointToPoint"]

T = TypeVar("T")
#: The dtype and shape a receive takes (its ``out=``), or ``None`` for any.
Want = tuple[str, tuple[int, ...]] | None


class PointToPoint(CommunicatorCore):
    """send / recv / isend / irecv (a part of :class:`~burncoll.Communicator`; the module
    docstring says what they promise)."""

    def send(self, x: Array, dst: int, tag: int = 0) -> None:
        """Send ``x`` to peer ``dst`` under ``tag``; returns once ``dst`` received it."""
        dst, tag = self._p2p_peer("send", dst, "dst"), check_tag("send", tag)
        if dst == self.peer_id:
            raise UsageError(
                f"send: dst={dst} is this peer itself; a blocking send to yourself could never "
                "complete (it returns once the message is received): use isend, then recv")
        self._send("send", x, dst, tag, wait=True)

    def isend(self, x: Array, dst: int, tag: int = 0) -> Work[None]:
        """Send ``x`` to peer ``dst`` under ``tag``; returns a :class:`~burncoll.Work` at once,
        completed when ``dst`` received it (keep ``x`` unchanged until then)."""
        dst, tag = self._p2p_peer("isend", dst, "dst"), check_tag("isend", tag)
        return self._in_flight(self._send("isend", x, dst, tag, wait=False))

    def recv(self, src: int, tag: int = 0, out: Array | None = None) -> Array:
        """The next message from peer ``src`` under ``tag``: a new array on this peer's device
        (or ``out``, filled; its dtype and shape must be the sender's)."""
        src, tag = self._p2p_peer("recv", src, "src"), check_tag("recv", tag)
        result: Array = self._recv("recv", src, tag, out, wait=True)
        return result

    def irecv(self, src: int, tag: int = 0, out: Array | None = None) -> Work[Any]:
        """Receive the next message from peer ``src`` under ``tag``; returns a
        :class:`~burncoll.Work` at once, completed with the array (as :meth:`recv`)."""
        src, tag = self._p2p_peer("irecv", src, "src"), check_tag("irecv", tag)
        work: Work[Any] = self._recv("irecv", src, tag, out, wait=False)
        return self._in_flight(work)

    def _in_flight(self, work: Work[T]) -> Work[T]:
        """Remember ``work`` until it completes, for :meth:`_finish_in_flight`."""
        self._p2p_in_flight.add(work)
        work.add_done_callback(self._p2p_in_flight.discard)
        return work

    def _finish_in_flight(self) -> None:
        """Before ``finish``: wait for this peer's isend / irecv in flight, as MPI requires
        them completed before a process leaves (each ends by its deadline at the latest; a
        failure was already raised to every peer, and is the user's to see in ``wait``)."""
        deadline = time.monotonic() + self._server.config.timeout + 1.0  # one, for them all
        for work in list(self._p2p_in_flight):
            with contextlib.suppress(CollectiveError):
                work.exception(max(deadline - time.monotonic(), 0.0))

    # -- the two directions ---------------------------------------------------------------
    def _send(self, label: str, x: Array, dst: int, tag: int, *, wait: bool) -> Work[None]:
        rv, backend = self._server, self._backend
        rv.check_usable(self._index)
        x = self._p2p_array(label, x)
        deadline = time.monotonic() + rv.config.timeout
        work: Work[None] = Work(f"{label} to peer {dst} (tag {tag})")
        link = rv.link
        if link is not None and link.node_of[dst] != link.node_index:
            future = link.p2p_send(self.peer_id, dst, tag, backend.to_host(x), deadline)
            if wait:
                _result(future, deadline, work.label)
            else:
                _complete(work, future, None)
            return work
        key = (self.peer_id, dst, tag)
        letter = Letter(backend.copy(x), backend.dtype_name(x), tuple(backend.shape(x)), work)
        timeout = rv.config.timeout

        def timed_out() -> BaseException:
            return CollectiveTimeout(
                f"send from peer {self.peer_id} to peer {dst} (tag {tag}) timed out after "
                f"{timeout:g} s: peer {dst} did not receive it. Hint: every send needs a "
                f"matching recv(src={self.peer_id}, tag={tag}) on peer {dst}")

        rv.post.post(key, letter)
        if wait:
            rv.post.wait(key, letter, work, deadline, timed_out)
        else:
            rv.post.watch(key, letter, work, deadline, timed_out)
        return work

    def _recv(self, label: str, src: int, tag: int, out: Array | None, *, wait: bool) -> Any:
        """The array (``wait``), or the :class:`~burncoll.Work` that completes with it."""
        rv = self._server
        rv.check_usable(self._index)
        want = None if out is None else self._p2p_out(label, out)
        deadline = time.monotonic() + rv.config.timeout
        work: Work[Any] = Work(f"{label} from peer {src} (tag {tag})")
        link = rv.link
        if link is not None and link.node_of[src] != link.node_index:
            future = link.p2p_recv(src, self.peer_id, tag, deadline, want)
            if wait:
                return self._received(_result(future, deadline, work.label), out)
            _complete(work, future, lambda host: self._received(host, out))
            return work
        key = (src, self.peer_id, tag)
        receipt = Receipt(work, lambda letter: self._deliver(letter, work, src, tag, out, want))
        timeout = rv.config.timeout

        def timed_out() -> BaseException:
            return CollectiveTimeout(
                f"recv from peer {src} (tag {tag}) on peer {self.peer_id} timed out after "
                f"{timeout:g} s: peer {src} sent no message with that tag. Hint: every recv "
                f"needs a matching send or isend(dst={self.peer_id}, tag={tag}) on peer {src}")

        rv.post.collect(key, receipt)
        if wait:
            return rv.post.wait(key, receipt, work, deadline, timed_out)
        rv.post.watch(key, receipt, work, deadline, timed_out)
        return work

    def _deliver(self, letter: Letter, work: Work[Any], src: int, tag: int,
                 out: Array | None, want: Want) -> BaseException | None:
        """Take a letter from this node's post office (in whichever thread matched it): the
        receiver's result, and ``None`` or the refusal its sender raises."""
        got = (letter.dtype, letter.shape)
        if want is not None and got != want:
            work.set_exception(MismatchError(
                f"recv from peer {src} (tag {tag}) on peer {self.peer_id}: the message is "
                f"{got[0]}{list(got[1])} but out is {want[0]}{list(want[1])}; they must match"))
            return MismatchError(
                f"send from peer {src} to peer {self.peer_id} (tag {tag}): peer "
                f"{self.peer_id} refused the message: its recv(out=...) takes "
                f"{want[0]}{list(want[1])}, the message is {got[0]}{list(got[1])}")
        backend, array = self._backend, letter.array
        if not backend.same_device(backend.device_of(array), self.device):
            array = backend.to_device(array, self.device)
        if out is not None:
            array = backend.copy(array, out=out)
        work.set_result(array)
        return None

    def _received(self, host: HostArray, out: Array | None) -> Array:
        """A message from another node (a new host array) on this peer's device, or in
        ``out``."""
        backend = self._backend
        array = backend.from_host(host, dtype_name(host.dtype), tuple(host.shape), self.device)
        return array if out is None else backend.copy(array, out=out)

    # -- checks -------------------------------------------------------------------------------
    def _p2p_peer(self, label: str, peer: object, name: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise UsageError(f"{label}: {name} must be a peer id (an int), got {peer!r}")
        if peer not in self._server.rank_of:
            raise UsageError(f"{label}: {name}={peer} is not a peer of this collective; peer "
                             f"ids are {list(self._server.world_peer_ids)}")
        return peer

    def _p2p_array(self, label: str, x: object) -> Array:
        x = self._checked(label, x)
        if len(self._backend.shape(x)) > MAX_NDIM:
            raise UsageError(f"{label}: arrays of more than {MAX_NDIM} dimensions cannot be "
                             "sent")
        return x

    def _p2p_out(self, label: str, out: object) -> tuple[str, tuple[int, ...]]:
        """What ``out`` takes (dtype and shape), once it is an array a message may fill."""
        backend = self._backend
        check_out(backend, self.device, out, label)
        return backend.dtype_name(out), tuple(backend.shape(out))


def check_tag(label: str, tag: object) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise UsageError(f"{label}: tag must be an int from 0 to {MAX_TAG} (it travels in 16 "
                         f"bits), got {tag!r}")
    return tag


def _result(future: concurrent.futures.Future[T], deadline: float, label: str) -> T:
    """From the caller's thread: the result of a node-level operation, which ends by its
    deadline (the guard past it only catches one that did not)."""
    try:
        return future.result(max(deadline - time.monotonic(), 0.0) + 1.0 + CLEANUP_GRACE)
    except concurrent.futures.CancelledError:
        raise _cancelled(label) from None
    except TimeoutError:
        if future.done():  # the operation's own timeout
            raise
    future.cancel()
    raise CollectiveTimeout(f"{label} did not complete within {1.0 + CLEANUP_GRACE:g} s of "
                            "its deadline")


def _complete(work: Work[T], future: concurrent.futures.Future[Any],
              convert: Callable[[Any], T] | None) -> None:
    """Complete ``work`` with ``future``'s outcome (``convert``-ed), once it has one."""
    def done(f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            work.set_exception(_cancelled(work.label))
            return
        error = f.exception()
        if error is not None:
            work.set_exception(error)
            return
        try:
            work.set_result(f.result() if convert is None else convert(f.result()))
        except Exception as exc:  # a device copy failed: the waiter hears of it
            work.set_exception(exc)

    future.add_done_callback(done)


def _cancelled(label: str) -> CollectiveAborted:
    return CollectiveAborted(f"{label} was cancelled: this node left the collective before it "
                             "completed")
