"""``NodeLink``: the :class:`~burncoll.levels.GlobalLink` of a real node.

Peer threads call its blocking methods; the work runs on the node's event loop. Built once
the node joined the collective (:mod:`burncoll.node.joining`), it runs global schedules with the
:class:`GlobalExecutor`, and fails the local peers (:class:`~burncoll.levels.LocalPeers`) on
any failure. Which route each operation takes (the exchange on a medium, the host reduction,
a strategy's schedule) is decided with the operation's plan, by the local level, from the
capabilities the nodes agreed at join (:meth:`NodeLink.share_host_memory`); the link only
dispatches it (``match route``), with no size test and no fallback.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, CollectiveTimeout, PeerLost
from burncoll.ioloop import IoLoop
from burncoll.levels import (
    Exchange,
    GlobalOp,
    HostArray,
    HostGather,
    HostReduce,
    LocalPeers,
    Medium,
    Route,
)
from burncoll.node.data_service import DataService
from burncoll.node.exchange import (
    ExchangeCores,
    exchange_all_reduce,
    exchange_receives,
    require_separate_out,
)
from burncoll.node.executor import GlobalExecutor
from burncoll.node.host_memory import HostMemory
from burncoll.node.host_reduce import host_all_reduce
from burncoll.node.lane_exchange import LaneExchange
from burncoll.node.membership import number_hosts
from burncoll.node.orchestrator_client import OrchestratorClient
from burncoll.node.p2p_link import NodePointToPoint
from burncoll.node.receives import Receives
from burncoll.ops import OpKind
from burncoll.strategies import Schedule, Strategy
from burncoll.strategies.layout import even_layout

__all__ = ["NodeLink"]

log = logging.getLogger("burncoll.node")
T = TypeVar("T")


class _JoinOp(GlobalOp):
    """The rounds that set up the host memory at join: operation number 0's rounds 1 and 2
    on the lanes, before any operation (as the first operation's were, when they ran in it)."""

    __slots__ = ()

    @property
    def label(self) -> str:
        return "register (host memory)"


class NodeLink:
    """This node's membership of a multi-node collective."""

    def __init__(self, io: IoLoop, service: DataService, orchestrator: OrchestratorClient) -> None:
        self._io = io
        self._service = service
        self._orch = orchestrator
        self._executor = GlobalExecutor(service)
        #: The exchange's protocol, by operation signature (on every medium).
        self._cores = ExchangeCores(self._executor)
        self.node_index = orchestrator.index
        self.nodes = orchestrator.nodes
        self.num_nodes = len(self.nodes)
        self.peer_ids = tuple(sorted(p for n in self.nodes for p in n.peer_ids))
        self.node_of: Mapping[int, int] = {p: n.index for n in self.nodes for p in n.peer_ids}
        #: Every node runs a local ring over the same number of devices, so an all-reduce can
        #: go local reduce-scatter -> per-shard global all-reduce -> local all-gather.
        self.sharded = all(n.sharded for n in self.nodes) and len(
            {len(n.peer_ids) for n in self.nodes}) == 1
        #: Every node announced this node's host identity: their rings share memory.
        self.hosts = number_hosts(self.nodes)
        self.one_host = bool(self.hosts) and max(self.hosts) == 0
        self._local: LocalPeers | None = None
        self._closed = False
        self.failure_reported = False  # (GlobalLink's: set by the API)
        self._p2p = NodePointToPoint(io, service, self.peer_ids, self.node_of)
        #: The exchange on caller sockets, when every node offers them.
        self._lanes = LaneExchange(service, self._executor, self._call, lambda error: (
            io.loop.call_soon_threadsafe(service.fail, error)), self._cores
        ) if service.uses_lanes else None
        self.lanes = self._lanes is not None
        #: The host memory of one host's node processes, once set up at join (with it, the
        #: host mail where every processor allows it: ``self._lanes.mail``).
        self._host_memory: HostMemory | None = None
        self.host_memory = self.host_mail = False
        service.on_failure = self._on_failure
        service.status = self._status
        orchestrator.on_node_lost = self._on_node_lost

    def share_host_memory(self, deadline: float) -> None:
        """(At join, from the registering thread, once the lanes are open.) Set up the host
        memory of node processes of one host (:meth:`HostMemory.set_up`), where a host runs
        2 of them or more: every node ends with the same ``host_memory`` (all on one host) and
        ``host_mail``, before the first plan is chosen. With the mail, every exchange goes
        there: the lanes' sockets are closed (2 descriptors per other node left, not 3)."""
        if self._lanes is None or len(set(self.hosts)) == len(self.hosts):
            return
        self._host_memory = HostMemory(self._lanes, self.hosts)
        op = _JoinOp(0, OpKind.BARRIER, None, None, (), -1, deadline, time.monotonic())
        self.host_memory = self._host_memory.set_up(op)
        self.host_mail = self._lanes.mail is not None
        if self.host_mail:  # (every exchange in the mail: the lanes served the handshake)
            self._service.lanes.drop_sockets()

    def attach(self, local: LocalPeers) -> None:
        """Route failures reported by other nodes to the ``local`` peers, and answer other
        nodes' status queries from them."""
        self._local = local
        error = self._service.mailbox.error
        if error is not None:
            local.fail(error, remote=True)

    # -- failure ----------------------------------------------------------------------------------
    def _on_failure(self, error: BaseException) -> None:
        if self._local is not None:
            self._local.fail(error, remote=True)

    def _on_node_lost(self, node: int) -> None:
        self._service.fail(PeerLost(
            f"{self.nodes[node].describe()} was lost (reported by the orchestrator); its "
            "process may have died"
        ))

    def _status(self) -> dict[str, Any]:
        local = self._local
        return {} if local is None else local.status()

    def abort(self, error: BaseException) -> None:
        if self._closed:
            return
        self.abort_now(error)

    def abort_now(self, error: BaseException) -> None:
        """Fail the node level with ``error`` and let the abort message leave (best effort)."""
        try:
            self._io.submit(self._abort(error)).result(3.0)
        except Exception:  # pragma: no cover - best effort
            log.debug("abort notification failed", exc_info=True)

    async def _abort(self, error: BaseException) -> None:
        self._service.fail(error)
        await self._service.flush_abort()

    def _flush_abort(self) -> None:
        """Best effort: let a pending abort message leave before the error is raised."""
        with contextlib.suppress(Exception):
            self._io.submit(self._service.flush_abort()).result(2.0)

    # -- running schedules ----------------------------------------------------------------
    def _call(self, op: GlobalOp, coro: Coroutine[Any, Any, T]) -> T:
        if self._lanes is not None:  # another node's exchange may wait on a lane instead
            coro = self._lanes.watched(op, coro)
        try:
            return self._io.run(coro, op.deadline, op.label)
        except CollectiveTimeout as exc:
            if exc is self._service.mailbox.error:  # another node's, already explained
                self._flush_abort()
                raise
            raise self._explain_timeout(op, exc) from None
        except CollectiveError:
            self._flush_abort()
            raise

    def _explain_timeout(self, op: GlobalOp, exc: CollectiveTimeout) -> CollectiveError:
        mismatch = self._lanes.waiting_mismatch(op) if self._lanes is not None else None
        if mismatch is not None:
            self.abort(mismatch)
            return mismatch
        others = [n.index for n in self.nodes if n.index != self.node_index]
        try:
            statuses = self._io.submit(self._service.query_status(others, 0.5)).result(2.0)
        except Exception:  # pragma: no cover - best effort
            statuses = {}
        never, late, silent = [], [], []
        for index in others:
            status = statuses.get(index)
            peers = self.nodes[index].peer_ids
            if status is None:
                silent.append(f"node {index} (peers {list(peers)}) did not answer")
                continue
            next_seq = status.next_seq or {}
            for p in peers:
                if next_seq.get(p, 0) > op.seq:
                    late.append(p)
                else:
                    never.append(p)
        parts = [str(exc)]
        if never:
            parts.append(f"peers that never called {op.label}: {never}")
        if late:
            parts.append(f"peers that called it but did not finish: {late}")
        parts.extend(silent)
        parts.append("hint: every peer must call the same operations in the same order; a node "
                     "that did not answer may have died (over QUIC a dead node is silent) or be "
                     "stuck in user code")
        error = CollectiveTimeout("; ".join(parts))
        self.abort(error)
        return error

    async def _run(self, op: GlobalOp, schedule: Schedule, chunks: list[HostArray | None],
                   channel: int = 0, out: list[HostArray | None] | None = None,
                   ) -> tuple[str | None, tuple[int, ...]]:
        executor = self._executor
        return await self._started(op, executor.receives(op, schedule, chunks, channel),
                                   lambda: executor.run(op, schedule, chunks, channel, out=out))

    async def _started(self, op: GlobalOp, receives: Receives,
                       work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` with the lane of ``op`` that ``receives`` describes started in the
        mailbox (the session's failure instead, if it failed)."""
        mailbox = self._service.mailbox
        if mailbox.error is not None:
            raise mailbox.error
        mailbox.expect(self._executor.checker(op), receives)
        try:
            return await work()
        finally:
            mailbox.done(op.seq)

    def _exchange(self, op: GlobalOp, buf: HostArray, out: HostArray, channel: int,
                  route: Exchange | HostGather) -> None:
        """The one-round exchange of ``buf`` into ``out`` (separate arrays) on its medium, or
        the host gather."""
        lanes = self._lanes
        match route:
            case Exchange(medium=Medium.CONNECTIONS):
                self._exchange_on_connections(op, buf, out, channel)
            case HostGather():
                assert lanes is not None and lanes.mail is not None, "choose: host_mail only"
                lanes.gather(op, buf, out, lanes.mail)
            case Exchange(medium=medium):
                assert lanes is not None, "choose gives the lanes only to sessions with them"
                lanes.all_reduce(op, buf, out, lanes.mail if medium is Medium.HOST else None)

    def _exchange_on_connections(self, op: GlobalOp, buf: HostArray, out: HostArray,
                                 channel: int) -> None:
        """The exchange on the event loop, over the member connections: what this node
        receives is registered with the mailbox as the operation starts there."""
        core = self._cores.of(op, buf.nbytes, channel)
        receives = exchange_receives(self._service, op, buf, channel)
        self._call(op, self._started(op, receives, lambda: exchange_all_reduce(
            self._executor, core, op, buf, out)))

    def all_reduce(self, op: GlobalOp, buf: HostArray, channel: int = 0,
                   out: HostArray | None = None, *, route: Route, fresh: bool = False) -> None:
        if out is not None and not fresh:
            require_separate_out(buf, out)
        match route:
            case Exchange() | HostGather():
                result = np.empty_like(buf) if out is None else out
                self._exchange(op, buf, result, channel, route)
                if out is None:
                    buf[...] = result
            case HostReduce():
                assert self._host_memory is not None, "choose needs host_memory for it"
                host_all_reduce(self._host_memory, op, buf, buf if out is None else out)
            case _:
                schedule = route.all_reduce(self.num_nodes)
                layout = even_layout(buf.size, schedule.num_chunks)
                chunks: list[HostArray | None] = [buf[a:b] for a, b in layout]
                outs: list[HostArray | None] | None = (
                    None if out is None else [out[a:b] for a, b in layout])
                self._call(op, self._run(op, schedule, chunks, channel, outs))

    def reduce(self, op: GlobalOp, buf: HostArray, root_node: int, *,
               strategy: Strategy) -> None:
        schedule = strategy.reduce(self.num_nodes, root_node)
        chunks: list[HostArray | None] = [
            buf[a:b] for a, b in even_layout(buf.size, schedule.num_chunks)]
        self._call(op, self._run(op, schedule, chunks))

    def broadcast(self, op: GlobalOp, buf: HostArray | None, root_node: int, *,
                  strategy: Strategy) -> HostArray:
        schedule = strategy.broadcast(self.num_nodes, root_node)
        if buf is not None:
            chunks: list[HostArray | None] = [
                buf[a:b] for a, b in even_layout(buf.size, schedule.num_chunks)]
        else:
            chunks = [None] * schedule.num_chunks
        dtype, shape = self._call(op, self._run(op, schedule, chunks))
        if buf is not None:
            return buf.reshape(op.shape)
        parts = [c for c in chunks if c is not None]
        if len(parts) != schedule.num_chunks:  # pragma: no cover - the schedule guarantees it
            raise CollectiveError(f"{op.label}: broadcast did not deliver every chunk")
        flat = np.concatenate(parts) if parts else np.empty(0, dtype_from_name(dtype or "uint8"))
        return flat.view(dtype_from_name(dtype or "uint8")).reshape(shape)

    def reduce_scatter(self, op: GlobalOp, buf: HostArray, layout: Sequence[tuple[int, int]],
                       owners: Sequence[int], *, strategy: Strategy) -> None:
        schedule = strategy.reduce_scatter(self.num_nodes, tuple(owners))
        chunks: list[HostArray | None] = [buf[a:b] for a, b in layout]
        self._call(op, self._run(op, schedule, chunks))

    def all_gather(self, op: GlobalOp, mine: Mapping[int, HostArray], *,
                   strategy: Strategy) -> list[HostArray]:
        owners = tuple(self.node_of[p] for p in self.peer_ids)
        schedule = strategy.all_gather(self.num_nodes, owners)
        chunks: list[HostArray | None] = [mine.get(r) for r in range(len(self.peer_ids))]
        self._call(op, self._run(op, schedule, chunks))
        return [c if c is not None else np.empty(0) for c in chunks]

    def route(self, op: GlobalOp, schedule: Schedule,
              chunks: list[HostArray | None]) -> list[HostArray | None]:
        self._call(op, self._run(op, schedule, chunks))
        return chunks

    def barrier(self, op: GlobalOp, *, route: Exchange | HostGather | Strategy) -> None:
        match route:
            case Exchange() | HostGather():  # empty messages: all leave together
                self._exchange(op, np.empty(0, np.uint8), np.empty(0, np.uint8), 0, route)
            case _:
                schedule = route.all_reduce(self.num_nodes)
                chunks: list[HostArray | None] = [
                    np.empty(0, np.uint8) for _ in range(schedule.num_chunks)]
                self._call(op, self._run(op, schedule, chunks))

    # -- point to point (burncoll.node.p2p_link) ------------------------------------------
    def p2p_send(self, src: int, dst: int, tag: int, buf: HostArray, deadline: float
                 ) -> Future[None]:
        return self._p2p.send(src, dst, tag, buf, deadline)

    def p2p_recv(self, src: int, dst: int, tag: int, deadline: float,
                 want: tuple[str, tuple[int, ...]] | None = None) -> Future[HostArray]:
        return self._p2p.recv(src, dst, tag, deadline, want)

    # -- leaving --------------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """Finish with every node (through the orchestrator), then close everything."""
        if self._closed:
            return
        self._closed = True
        local = self._local.failure if self._local is not None else None
        if local is not None and self._service.mailbox.error is None:
            # a local peer failed and another peer, woken by it, closes the node before the
            # failing thread told the node level: tell the other nodes now, never wait for a
            # finish that they will not send
            self.abort_now(local)
        error: BaseException | None = None
        try:
            if (failed := self._service.mailbox.error) is None:  # (ends early if it fails)
                finishing = self._orch.finish(deadline, self._service.failure)
                self._io.run(finishing, deadline, "finish")
            elif isinstance(failed, CollectiveError) and not self.failure_reported:
                raise failed  # (it failed after this node's calls returned: say so once)
        except CollectiveError as exc:
            error = exc
        finally:
            try:
                self._io.submit(self._shutdown()).result(5.0)
            except Exception:  # pragma: no cover - best effort
                log.debug("shutdown failed", exc_info=True)
            self._io.stop()
        if error is not None:
            raise error

    async def _shutdown(self) -> None:
        await self._service.close()  # (first: its connections let go of their regions)
        if self._host_memory is not None:
            self._host_memory.close()
        await self._orch.close()
