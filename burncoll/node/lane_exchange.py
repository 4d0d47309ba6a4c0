"""The one-round exchange over the caller sockets (:mod:`burncoll.node.lanes`), run by the
calling peer thread from start to end: it sends its message on every lane (or through the
host mail, where the route says ``Medium.HOST``), reads every other node's, and has
:class:`~burncoll.protocol.exchange.ExchangeCore` -- the protocol the event loop's exchange
(:mod:`burncoll.node.exchange`) drives too -- check them and reduce in node order. The rounds
of the host memory (:mod:`burncoll.node.host_memory`, :mod:`burncoll.node.host_reduce`) go
the same way (:meth:`LaneExchange.trade`), and so does the host gather
(:meth:`LaneExchange.gather`: node 0's exchange, then its result to the others).

The operation still starts its lane in the mailbox (``Mailbox.skip``, without the event loop
where nothing needs it): a frame of this operation that arrives on a member connection --
another node's different call -- is then checked against this call and reported as before.
Every failure becomes the error the event loop's exchange raises, through the event loop where
it must be reported there (``call``): the session's own failure, a timeout with its
explanation, a lost node (after the grace an explanation is given), a mismatch or a malformed
message that fails the session on every node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import numpy as np

from burncoll.errors import CollectiveError, PeerLost, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.exchange import ExchangeCores
from burncoll.node.host_mail import SharedMail
from burncoll.node.lanes import LaneClosed, LaneOdd, LaneTimeout, LaneWoken
from burncoll.node.receives import Receives
from burncoll.node.spinning import usable_cpus
from burncoll.protocol.checks import Check, header_check, order_mismatch
from burncoll.protocol.exchange import ExchangeCore, payload_bytes
from burncoll.protocol.wire import FIXED_HEADER_BYTES, MAX_NDIM, decode_data_head
from burncoll.transport.base import Buffer

if TYPE_CHECKING:
    from burncoll.node.data_service import DataService
    from burncoll.node.executor import GlobalExecutor

__all__ = ["LaneExchange"]

#: Runs a coroutine on the node's event loop for ``op`` and returns or raises its outcome.
Call = Callable[[GlobalOp, Coroutine[Any, Any, None]], None]


#: The node that reduces in the host gather (``levels.HostGather``).
ROOT = 0
#: Where a message of the host mail was read, in the words of errors.
IN_MAIL = "in the shared mail"
#: The longest message header: as far as a report reads another node's message.
_HEAD_BYTES = FIXED_HEADER_BYTES + 8 * MAX_NDIM
#: Seconds after which an operation without the exchange looks at the lanes (the last one
#: repeats until it ends).
PEEKS = (0.01, 0.05, 0.25, 1.0)
T = TypeVar("T")


class LaneExchange:
    """The exchange of one node on its lanes; ``call`` is the link's way onto the loop."""

    def __init__(self, service: DataService, executor: GlobalExecutor, call: Call,
                 fail_soon: Callable[[BaseException], object], cores: ExchangeCores) -> None:
        self.service = service
        self.executor = executor
        self.call = call
        #: Fails the session from this thread, without waiting (``DataService.fail`` on
        #: the loop).
        self.fail_soon = fail_soon
        #: Shared mail among node processes of one host, set up at join with their host
        #: memory (:mod:`burncoll.node.host_mail`), for the routes that take it.
        self.mail: SharedMail | None = None
        #: The exchange's protocol, by operation signature (the link's one cache).
        self.cores = cores
        #: This node and the others (the session's table does not change).
        self._me = service.node_index
        self._others = tuple(n.index for n in service.nodes if n.index != self._me)
        hosts = [n.host_id for n in service.nodes]
        mine = hosts[self._me]
        # spinning while another node of this host waits for a CPU would only delay it
        service.lanes.spinning.allowed = usable_cpus() >= (hosts.count(mine) if mine else 1)

    def all_reduce(self, op: GlobalOp, buf: HostArray, out: HostArray, mail: SharedMail | None
                   ) -> None:
        """``out = x0 op x1 op ...`` over every node's ``buf`` (``buf`` is only read), in
        ``mail`` (the route's ``Medium.HOST``: :attr:`mail`) or on the lanes (``None``)."""
        self.run(op, buf.nbytes, self._exchange_into, op, buf, out, mail)

    def _exchange_into(self, check: Check, op: GlobalOp, buf: HostArray, out: HostArray,
                       mail: SharedMail | None) -> None:
        """The exchange of ``buf`` into ``out`` (separate arrays) inside :meth:`run`."""
        core = self.cores.of(op, buf.nbytes)
        received = self.trade(op, check, core.header(op.seq), payload_bytes(buf), mail, core)
        core.reduce_messages(op, buf, received, out)

    def gather(self, op: GlobalOp, buf: HostArray, out: HostArray, mail: SharedMail) -> None:
        """``out = x0 op x1 op ...`` over every node's ``buf`` (only read) through the host
        gather (``levels.HostGather``): node :data:`ROOT` reduces every node's message in node
        order, as the exchange does, and posts the result, which the others check and copy."""
        self.run(op, buf.nbytes, self._gather_into, op, buf, out, mail)

    def _gather_into(self, check: Check, op: GlobalOp, buf: HostArray, out: HostArray,
                     mail: SharedMail) -> None:
        """The host gather of ``buf`` into ``out`` (separate arrays) inside :meth:`run`."""
        core = self.cores.of(op, buf.nbytes)  # (``out`` is like ``buf``: the link checks)
        if self._me == ROOT:
            received = self.trade(op, check, core.header(op.seq), payload_bytes(buf), mail,
                                  core, post=False)
            core.reduce_messages(op, buf, received, out)
            mail.post((core.result_header(op.seq), payload_bytes(out)), skip=1)
            return
        mine, size = core.result_header(op.seq), core.expected_bytes
        try:
            message = mail.gather(self.service.lanes, (core.header(op.seq), payload_bytes(buf)),
                                  size, ROOT, op.deadline)
        except (LaneWoken, LaneTimeout, LaneClosed, LaneOdd) as stop:
            self._raise(op, self._stopped(op, check, core, mine, stop))
        if core.check(op, check, ROOT, message, mine, IN_MAIL) is not None:
            seen = mail.read(ROOT, mail.posted_count + 1, max(size, _HEAD_BYTES))
            self._raise(op, self._fail(core.wrong(op, check, ROOT, seen, mine, IN_MAIL)))
        out[...] = np.frombuffer(message, out.dtype, offset=core.header_bytes).reshape(out.shape)
        mail.post((mine,))  # (its number: the slot it fills was read by every node)

    def run(self, op: GlobalOp, nbytes: int, body: Callable[..., T], *args: Any) -> T:
        """Run ``body(check, *args)`` -- operation ``op``'s rounds on the lanes
        (:meth:`trade`) -- with channel 0 of ``op`` skipped in the mailbox
        (:meth:`~burncoll.node.mailbox.Mailbox.skip`): a frame of ``op`` arriving on a member
        connection (another node's different call) is checked against it and reported.
        (``nbytes``, what every other node sends first, is not needed there.)"""
        service, mailbox = self.service, self.service.mailbox
        check = header_check(op, self._me, self.executor.describe)  # (executor.checker's)
        started = [mailbox.skip(op.seq, check)]
        try:
            if not started[0]:  # the loop works first
                started.pop()
                self.call(op, self._start(check, op.seq, started))
            return body(check, *args)
        except CollectiveError:
            raise
        except BaseException as exc:  # an interrupt, an error of NumPy's: lanes are shut
            self.fail_soon(CollectiveError(
                f"{op.label} stopped on {self.executor.describe(service.node_index)} "
                f"({type(exc).__name__}: {exc}); the session cannot go on: register again"))
            raise
        finally:
            if started:
                mailbox.done(op.seq)

    def trade(self, op: GlobalOp, check: Check, header: bytes, payload: Buffer,
              mail: SharedMail | None, core: ExchangeCore | None = None, *,
              post: bool = True) -> Mapping[int, Buffer]:
        """One round: send ``header`` (this node's, for ``op``) and ``payload`` through
        ``mail`` (it fits: the route said so; not ``post``: the host gather's root, which only
        reads), or on every lane without it, and read every
        other node's message of the same length, which ``core`` (the exchange's of this
        payload size) must find to be the same header from that node; its bytes by node (the
        header, then the payload; in the mail, a view of the other node's slot, valid until
        this node posts again)."""
        size = len(header) + memoryview(payload).nbytes
        core = core or self.cores.of(op, size - len(header))
        lanes = self.service.lanes
        received: Mapping[int, Buffer]
        try:
            if mail is None:
                message = b"".join((header, payload))  # the payload's one copy
                received = lanes.exchange(message, size, op.deadline)
            else:  # (header and payload straight into this node's slot)
                received = mail.exchange(lanes, (header, payload) if post else None, size,
                                         op.deadline)
        except (LaneWoken, LaneTimeout, LaneClosed, LaneOdd) as stop:
            self._raise(op, self._stopped(op, check, core, header, stop))
        where = "on its caller socket" if mail is None else IN_MAIL
        for node, data in received.items():
            if core.check(op, check, node, data, header, where) is None:
                continue
            seen: Buffer = data
            if mail is not None:  # (its whole header, for the report: a longer call's)
                seen = mail.read(node, mail.posted_count + (not post), max(size, _HEAD_BYTES))
            self._raise(op, self._fail(core.wrong(op, check, node, seen, header, where)))
        return received

    def refuse(self, op: GlobalOp, error: CollectiveError) -> NoReturn:
        """Fail the session with ``error`` (found in ``op``) on every node, and raise it."""
        self._raise(op, self._fail(error))

    def _raise(self, op: GlobalOp, coro: Coroutine[Any, Any, None]) -> NoReturn:
        """Run ``coro`` on the loop; it raises the operation's error."""
        self.call(op, coro)
        raise AssertionError("unreachable: the coroutine raises")  # pragma: no cover

    async def _start(self, check: Check, seq: int, started: list[bool]) -> None:
        """:meth:`run`'s skip on the loop, which reports the frames of the operation that
        came on the member connections (none may: the lane receives nothing there)."""
        mailbox = self.service.mailbox
        if mailbox.error is None:
            started.append(True)  # (whatever expect finds, ``done`` ends the lane)
            mailbox.expect(check, Receives(seq, 0, {}))
        if mailbox.error is not None:
            raise mailbox.error

    async def _fail(self, error: CollectiveError) -> None:
        self.service.fail(error)
        raise self.service.mailbox.error or error

    async def _stopped(self, op: GlobalOp, check: Check, core: ExchangeCore, header: bytes,
                       stop: Exception) -> None:
        """Raise what ended the exchange early, as the event loop's exchange would."""
        service = self.service
        if isinstance(stop, LaneTimeout):
            raise self.executor.timeout_error(op, stop.node, 0)
        if isinstance(stop, LaneClosed):
            describe = self.executor.describe(stop.node)
            await service.await_explanation()
            service.fail(PeerLost(f"{describe} is unreachable: its caller socket: "
                                  f"{stop.reason}"))
        elif isinstance(stop, LaneOdd):
            await self._fail(core.wrong(op, check, stop.node, stop.head, header))
        raise service.mailbox.error or PeerLost("the session was closed")


    async def watched(self, op: GlobalOp, coro: Coroutine[Any, Any, T]) -> T:
        """(Event loop.) Run ``coro``, an operation without the exchange (or the loop's part
        of one), and look at the lanes now and then meanwhile (:data:`PEEKS`): a message of
        this or an earlier operation waiting there means its sender called an exchange in
        this operation's place, which would wait on its lane for this node while this node
        waits for it. That mismatch fails the session at once, naming both calls."""
        loop = asyncio.get_running_loop()
        delays = iter(PEEKS)

        handles: list[asyncio.TimerHandle] = []

        def look() -> None:
            error = self.waiting_mismatch(op)
            if error is not None:
                self.service.fail(error)
                return
            handles[0] = loop.call_later(next(delays, PEEKS[-1]), look)

        handles.append(loop.call_later(next(delays), look))
        try:
            return await coro
        finally:
            handles[0].cancel()

    def waiting_mismatch(self, op: GlobalOp) -> CollectiveError | None:
        """For an operation without the exchange that timed out: a message of this or an
        earlier operation waiting on a lane means that node called an exchange in its place
        (a mismatch, reported as such); ``None`` when no lane holds one."""
        waiting = self.service.lanes.peek(_HEAD_BYTES)
        mail = self.mail
        if mail is not None:  # (an exchange posted there is as one sent on the lane)
            waiting.update(mail.pending(_HEAD_BYTES))
        for node, head in waiting.items():
            try:
                h, _ = decode_data_head(memoryview(head))
            except ProtocolError:
                continue  # not even a header yet: nothing to tell
            if h.src != node or h.seq > op.seq:
                continue  # a node ahead: its next exchange waits for this node
            if h.seq < op.seq:  # an earlier exchange this node never ran
                return order_mismatch(op, self.service.node_index, self.executor.describe, h)
            error = self.executor.checker(op)(h)
            if error is not None:
                return error
        return None

