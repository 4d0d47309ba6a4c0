"""One node process of the fault-injection tests; uses the public API only.

Usage: ``python worker.py SPEC_JSON``. The spec names the scenario, this node's rank, the
cluster's shape and the faults to inject (see :func:`main`). The worker prints JSON lines on
stdout: ``{"event": ...}`` as things happen (the test reacts to some of them), and at the end
one ``{"peer": id, ...}`` record per local peer: how each operation ended, the error type and
message, and how long the failing call took.

Faults are injected from inside (a node SIGKILLs itself mid-operation, a peer sleeps instead
of calling) or, for the frame tests, through :class:`FaultyTransport`: a real transport whose
connections drop, delay or duplicate one DATA frame (the one test double, patched in before
``register``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import burncoll
from burncoll.protocol.wire import FrameType, Placed, decode
from burncoll.transport import get_transport as real_get_transport
from burncoll.transport.base import Buffer, Connection, Handler, Listener, Transport

_print_lock = threading.Lock()


def emit(record: dict[str, Any]) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


# -- the frame-fault test double --------------------------------------------------------------


class _Faults:
    """Which outgoing DATA frame of this process to tamper with, shared by every connection."""

    def __init__(self, mode: str, nth: int, delay: float) -> None:
        self.mode = mode
        self.nth = nth
        self.delay = delay
        self.sent = 0
        self.injected = False


class FaultyConnection(Connection):
    """A real connection whose ``nth`` outgoing DATA frame is dropped, delayed or doubled."""

    def __init__(self, inner: Connection, faults: _Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.remote = inner.remote

    async def send(self, parts: Sequence[Buffer]) -> None:
        f = self.faults
        if decode(b"".join(bytes(p) for p in parts)).frame_type == FrameType.DATA:
            f.sent += 1
            if f.sent == f.nth:
                f.injected = True
                emit(
                    {
                        "event": "fault",
                        "mode": f.mode,
                        "frame": f.sent,
                        "to": self.remote,
                        "t": time.time(),
                    }
                )
                if f.mode == "drop":
                    return
                if f.mode == "delay":
                    await asyncio.sleep(f.delay)
                elif f.mode == "duplicate":
                    await self.inner.send(parts)
                elif f.mode == "close":
                    await self.inner.close()
        await self.inner.send(parts)

    async def recv(self) -> Buffer | Placed:
        return await self.inner.recv()

    async def close(self) -> None:
        await self.inner.close()

    def authenticated(self) -> None:
        self.inner.authenticated()

    def channel_binding(self) -> bytes:
        return self.inner.channel_binding()


class FaultyTransport(Transport):
    """Wraps a real transport; accepted connections (the ones a node sends on) tamper with
    one DATA frame."""

    def __init__(self, inner: Transport, faults: _Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.name = inner.name

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        async def faulty(conn: Connection) -> None:
            await handler(FaultyConnection(conn, self.faults))

        return await self.inner.listen(host, port, faulty)

    async def connect(self, host: str, port: int) -> Connection:
        return await self.inner.connect(host, port)


def patch_transport(mode: str, nth: int, delay: float) -> _Faults:
    """Make every node connection of this process a :class:`FaultyConnection`."""
    import burncoll.node.joining as joining

    faults = _Faults(mode, nth, delay)
    real = real_get_transport

    def faulty(name: str, **kwargs: Any) -> Transport:
        return FaultyTransport(real(name, **kwargs), faults)

    vars(joining)["get_transport"] = faulty  # the name joining.py calls
    return faults


# -- operations ---------------------------------------------------------------------------------


def data(pid: int, n: int, k: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.float64) * 3 + pid * 7 + k) % 11 - 5) / 4


KINDS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "barrier")


def one_op(comm: burncoll.Communicator, kind: str, k: int, n: int) -> None:
    """Operation ``k`` of kind ``kind`` on ``n`` elements, checked against NumPy afterwards
    (so that a timing around this call measures the operation)."""
    pid, ids = comm.peer_id, comm.peer_ids
    root = ids[k % len(ids)]
    if kind == "all_reduce":
        got = comm.all_reduce(data(pid, n, k))
    elif kind == "reduce":
        got = comm.reduce(data(pid, n, k), root=root)
    elif kind == "broadcast":
        got = comm.broadcast(data(pid, n, k) if pid == root else None, root=root)
    elif kind == "reduce_scatter":
        got = comm.reduce_scatter(data(pid, n, k))
    elif kind == "all_gather":
        got = comm.all_gather(data(pid, 1 + (n + pid) % 5, k))
    else:
        comm.barrier()
        got = None
    expect: np.ndarray | None = None
    if kind in ("all_reduce", "reduce", "reduce_scatter"):
        total = np.sum([data(p, n, k) for p in ids], axis=0)
        if kind == "all_reduce" or (kind == "reduce" and pid == root):
            expect = total
        elif kind == "reduce_scatter":
            expect = np.array_split(total, comm.world_size)[comm.rank]
    elif kind == "broadcast":
        expect = data(root, n, k)
    elif kind == "all_gather":
        expect = np.concatenate([data(p, 1 + (n + p) % 5, k) for p in ids])
    if expect is None:
        if got is not None:
            raise AssertionError(f"{kind} #{k} returned {type(got).__name__}, expected None")
    elif got is None or got.shape != expect.shape or not np.allclose(got, expect, rtol=1e-12):
        raise AssertionError(f"WRONG RESULT: {kind} #{k} on peer {pid}")


def segments_mapped() -> int:
    """How many host memory files (sealed files of burncoll's of 32 MiB or more: with 3 nodes,
    the mail, the data slot and the stream regions) this process maps, from
    ``/proc/self/maps``."""
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            count += "memfd:burncoll-" in line and end - start >= 32 << 20
    return count


def op_sequence(spec: dict[str, Any]) -> Callable[[int], str]:
    kinds = KINDS if spec.get("mix") else ("all_reduce",)
    return lambda k: kinds[k % len(kinds)]


# -- one peer -----------------------------------------------------------------------------------


class Node:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.node: int = spec["node"]
        self.devices: int = spec["devices"]
        self.go = threading.Event()
        self.local_barrier = threading.Barrier(self.devices)
        self.config = self.make_config()

    def make_config(self) -> burncoll.CollectiveConfig:
        s = self.spec
        ports = s.get("ports")
        return burncoll.CollectiveConfig(
            num_devices=s["devices"],
            num_nodes=s["nodes"],
            global_address=s["address"],
            node_address="127.0.0.1",
            data_service_port=ports[self.node] if ports else 0,
            transport=s["transport"],
            timeout=s["timeout"],
            local_all_reduce_strategy=s["local"],
            local_reduce_strategy=s["local"],
            local_broadcast_strategy=s["local"],
            global_all_reduce_strategy=s["global"],
            global_reduce_strategy=s["global"],
            global_broadcast_strategy=s["global"],
        )

    def peer_id(self, local: int) -> int:
        return self.node * self.devices + local

    def register(
        self, pid: int, local: int, rec: dict[str, Any], attempts: int
    ) -> burncoll.Communicator:
        """``register``, tried again up to ``attempts`` times: nodes that come back after a
        failure do not come back at the same moment, and one whose registration deadline
        passes just as the session forms leaves the others unable to connect to it."""
        for attempt in range(attempts):
            try:
                return burncoll.register(pid, local, self.config)
            except burncoll.CollectiveError:
                if attempt == attempts - 1:
                    raise
                rec["register_attempts"] = attempt + 2
        raise AssertionError("unreachable")

    # -- the scenarios ---------------------------------------------------------------------------
    def run_peer(self, local: int) -> dict[str, Any]:
        s = self.spec
        pid = self.peer_id(local)
        rec: dict[str, Any] = {"peer": pid, "node": self.node}
        started = time.monotonic()
        try:
            # a replacement node retries, as a supervisor would
            comm = self.register(pid, local, rec, 4 if s.get("generation", 0) > 0 else 1)
        except burncoll.CollectiveError as exc:
            rec.update(
                stage="register",
                ok=False,
                error=type(exc).__name__,
                message=str(exc),
                elapsed=time.monotonic() - started,
            )
            return rec
        rec["register_s"] = time.monotonic() - started
        scenario = s["scenario"]
        if scenario == "orch_kill":
            return self.orch_kill(comm, local, rec)
        if scenario == "reregister":
            return self.reregister(comm, local, rec)
        if scenario == "restart":
            return self.restart(comm, local, rec)
        if scenario == "ops":
            return self.ops(comm, rec, s.get("count", 6))
        return self.faulty_run(comm, local, rec)

    def faulty_run(
        self, comm: burncoll.Communicator, local: int, rec: dict[str, Any]
    ) -> dict[str, Any]:
        """kill / stuck / frames: run ``count`` operations until one fails."""
        s = self.spec
        kind_of = op_sequence(s)
        victim = self.node == s.get("victim")
        for k in range(s["count"]):
            if victim and s["scenario"] == "kill" and k == s["at"] and local == 0:
                self.kill_soon(s.get("jitter", 0.02))
            if victim and s["scenario"] == "stuck" and k == s["at"] and local in s["stuck"]:
                emit({"event": "stuck", "peer": comm.peer_id, "t": time.time()})
                time.sleep(s["stuck_s"])
                rec["stuck"] = True
                return self.after_failure(comm, rec, kind_of(k), k)
            if k == 1 and s.get("host_memory"):
                rec["segments_mapped"] = segments_mapped()
            t0 = time.monotonic()
            try:
                # the first operation may be big: chunks of several parts (frames)
                one_op(comm, kind_of(k), k, s.get("big", s["size"]) if k == 0 else s["size"])
            except burncoll.CollectiveError as exc:
                # CollectiveAborted when the failure came in between two calls: the original
                # error is its cause
                rec.update(
                    ok=False,
                    op=k,
                    kind=kind_of(k),
                    error=type(exc).__name__,
                    cause=type(exc.__cause__).__name__,
                    message=str(exc),
                    elapsed=time.monotonic() - t0,
                    t=time.time(),
                )
                return self.after_failure(comm, rec, kind_of(k), k + 1)
            except AssertionError as exc:
                rec.update(ok=False, op=k, error="WRONG", message=str(exc))
                return rec
        rec["ok"] = True
        self.finish(comm, rec)
        return rec

    def after_failure(
        self, comm: burncoll.Communicator, rec: dict[str, Any], kind: str, k: int
    ) -> dict[str, Any]:
        """Later calls must raise CollectiveAborted at once; finish must not hang."""
        t0 = time.monotonic()
        try:
            one_op(comm, kind, k, self.spec["size"])
            rec["then"] = "ok"
        except burncoll.CollectiveError as exc:
            rec["then"] = type(exc).__name__
            rec["then_message"] = str(exc)
        except AssertionError:
            rec["then"] = "WRONG"
        rec["then_s"] = time.monotonic() - t0
        self.finish(comm, rec)
        return rec

    def finish(self, comm: burncoll.Communicator, rec: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            comm.finish()
            rec["finish"] = "ok"
        except burncoll.CollectiveError as exc:
            rec["finish"] = type(exc).__name__
            rec["finish_message"] = str(exc)
        rec["finish_s"] = time.monotonic() - t0

    def kill_soon(self, jitter: float) -> None:
        """SIGKILL this process a few milliseconds from now (mid-operation)."""

        def killer() -> None:
            time.sleep(random.uniform(0.0, jitter))
            emit({"event": "kill", "node": self.node, "t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()

    def ops(self, comm: burncoll.Communicator, rec: dict[str, Any], count: int) -> dict[str, Any]:
        try:
            for k in range(count):
                one_op(comm, KINDS[k % len(KINDS)], k, self.spec["size"])
            rec["ok"] = True
        except burncoll.CollectiveError as exc:
            rec.update(ok=False, error=type(exc).__name__, message=str(exc))
        except AssertionError as exc:
            rec.update(ok=False, error="WRONG", message=str(exc))
        self.finish(comm, rec)
        return rec

    def orch_kill(
        self, comm: burncoll.Communicator, local: int, rec: dict[str, Any]
    ) -> dict[str, Any]:
        """Registered -> (the test kills the orchestrator) -> operations -> finish -> register."""
        self.local_barrier.wait()
        if local == 0:
            emit({"event": "registered", "node": self.node})
        self.go.wait(60)
        try:
            for k in range(2 * len(KINDS)):
                one_op(comm, KINDS[k % len(KINDS)], k, self.spec["size"])
            rec["ops"] = "ok"
        except burncoll.CollectiveError as exc:
            rec.update(ops=type(exc).__name__, message=str(exc))
        except AssertionError:
            rec["ops"] = "WRONG"
        self.finish(comm, rec)
        t0 = time.monotonic()
        try:
            again = burncoll.register(comm.peer_id, local, self.config)
            rec["register_again"] = "ok"
            again.finish()
        except burncoll.CollectiveError as exc:
            rec["register_again"] = type(exc).__name__
            rec["register_again_message"] = str(exc)
        rec["register_again_s"] = time.monotonic() - t0
        return rec

    def reregister(
        self, comm: burncoll.Communicator, local: int, rec: dict[str, Any]
    ) -> dict[str, Any]:
        """A mismatch aborts everything; every peer registers again in this process."""
        size = self.spec["size"]
        for round_ in range(self.spec.get("rounds", 2)):
            try:
                one_op(comm, "all_reduce", 0, size)
                comm.all_reduce(np.ones(size + (self.node == 1)))
                rec[f"mismatch_{round_}"] = "none"
            except burncoll.CollectiveError as exc:
                # a peer that calls only after its node learnt of the mismatch from another
                # node raises the CollectiveAborted that every later call raises, caused by it
                cause = exc.__cause__ if isinstance(exc, burncoll.CollectiveAborted) else exc
                rec[f"mismatch_{round_}"] = type(cause).__name__
            try:
                comm.all_reduce(np.ones(size))
                rec[f"after_{round_}"] = "ok"
            except burncoll.CollectiveError as exc:
                rec[f"after_{round_}"] = type(exc).__name__
            if self.spec.get("finish_first"):
                self.finish(comm, rec)
            t0 = time.monotonic()
            try:
                comm = burncoll.register(comm.peer_id, local, self.config)
            except burncoll.CollectiveError as exc:
                rec.update(
                    ok=False,
                    error=type(exc).__name__,
                    message=str(exc),
                    stage=f"register again {round_}",
                )
                return rec
            rec[f"register_again_{round_}_s"] = time.monotonic() - t0
            # the aborted node was left before the new one was built: one I/O thread
            rec[f"io_threads_{round_}"] = io_threads()
        return self.ops(comm, rec, 2 * len(KINDS))

    def restart(
        self, comm: burncoll.Communicator, local: int, rec: dict[str, Any]
    ) -> dict[str, Any]:
        """A node dies; the survivors register again, with a new process in its place."""
        s = self.spec
        if s.get("generation", 0) > 0:  # the replacement
            return self.ops(comm, rec, 2 * len(KINDS))
        victim = self.node == s["victim"]
        try:
            for k in range(s["count"]):
                if victim and k == s["at"] and local == 0:
                    self.kill_soon(0.01)
                one_op(comm, "all_reduce", k, s["size"])
            rec.update(ok=False, error="none", message="the failure was not seen")
            return rec
        except burncoll.CollectiveError as exc:
            rec["first_error"] = type(exc).__name__
        self.local_barrier.wait()
        if local == 0:
            emit({"event": "failed", "node": self.node})
        t0 = time.monotonic()
        try:
            # tried for as long as a new process may take to start on a busy host (its
            # supervisor starts it only after both survivors have failed)
            comm = self.register(comm.peer_id, local, rec, 12)
        except burncoll.CollectiveError as exc:
            rec.update(ok=False, error=type(exc).__name__, message=str(exc), stage="register again")
            return rec
        rec["register_again_s"] = time.monotonic() - t0
        return self.ops(comm, rec, 2 * len(KINDS))


def io_threads() -> int:
    return sum(t.name.startswith("burncoll-node") for t in threading.enumerate())


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    frames = spec.get("frames") if spec["node"] == spec.get("victim") else None
    if frames:
        faults = patch_transport(frames["mode"], frames["nth"], frames.get("delay", 0.0))
    node = Node(spec)

    start = threading.Event()

    def read_commands() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                node.go.set()
            elif line.strip() == "start":
                start.set()

    threading.Thread(target=read_commands, daemon=True).start()
    records: list[dict[str, Any]] = []

    def peer(local: int) -> None:
        try:
            records.append(node.run_peer(local))
        except BaseException as exc:  # a bug in a test scenario: report it, never hang
            records.append(
                {
                    "peer": node.peer_id(local),
                    "ok": False,
                    "error": "CRASH",
                    "message": f"{type(exc).__name__}: {exc}",
                }
            )

    # every node of the cluster registers at once: on a busy host, starting Python alone can
    # take longer than a short timeout, which would fail a registration before the test begins
    real_get_transport(spec["transport"])  # its modules imported, like burncoll's
    emit({"event": "ready"})
    if not start.wait(120):
        raise SystemExit("the test never said start")
    threads = [threading.Thread(target=peer, args=(i,)) for i in range(node.devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit({"event": "exit", "io_threads": io_threads()})
    if frames:
        emit({"event": "faults", "injected": faults.injected, "sent": faults.sent})
    for r in records:
        emit(r)


if __name__ == "__main__":
    main()
