"""The out-of-place global all-reduce: the input is only read, the result goes to ``out``.

Two levels: the :class:`GlobalExecutor` alone, several nodes in one event loop over an
in-memory data service (every strategy, parts of a few bytes so that the pipeline interleaves
sends and receives of the same chunk, compared bitwise with the in-place walk); and real node
processes with one device each through an orchestrator, where ``all_reduce`` takes that path
and must never copy (nor modify) the caller's input.

Run as a script, this file is one node process of the second level (see :func:`_node_main`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.executor as executor_module
from burncoll.dtypes import dtype_from_name
from burncoll.errors import ProtocolError
from burncoll.levels import GlobalOp
from burncoll.node.exchange import require_separate_out
from burncoll.node.executor import PART_BYTES, GlobalExecutor
from burncoll.node.mailbox import Mailbox
from burncoll.node.membership import NodeInfo
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.wire import decode
from burncoll.strategies import Centralized, Ring, Schedule, Strategy, Tree
from burncoll.strategies.layout import even_layout
from tests import forked

REPO = Path(__file__).resolve().parents[2]

# -- the executor alone, over an in-memory data service ------------------------------------


class _MemoryService:
    """Just what :class:`GlobalExecutor` uses of a data service; frames go through the real
    wire encoding into the other node's real mailbox."""

    def __init__(self, index: int, world: int) -> None:
        self.node_index = index
        self.nodes = tuple(NodeInfo(i, "127.0.0.1", 0, (i,)) for i in range(world))
        self.session = 7
        self.mailbox = Mailbox()
        self.others: list[_MemoryService] = []

    async def send(self, node: int, parts: Sequence[Any]) -> None:
        try:
            self.others[node].mailbox.put(decode(b"".join(bytes(p) for p in parts)))
        except ProtocolError as exc:  # as the data service's reader does
            self.fail(ProtocolError(f"node {self.node_index} {exc}"))
        await asyncio.sleep(0)  # let the receivers run between parts

    def fail(self, error: BaseException) -> None:
        for service in self.others:
            service.mailbox.fail(error)


def _walk(schedule: Schedule, op: GlobalOp, inputs: list[np.ndarray],
          out_of_place: bool) -> list[np.ndarray]:
    """Every node's buffer after walking ``schedule``: ``out`` or the reduced-in-place input."""
    world = len(inputs)
    services = [_MemoryService(i, world) for i in range(world)]
    for s in services:
        s.others = services
    layout = even_layout(inputs[0].size, schedule.num_chunks)
    bufs = [x if out_of_place else x.copy() for x in inputs]
    outs = [np.full_like(x, np.nan) for x in inputs]

    async def node(i: int) -> None:
        ex = GlobalExecutor(services[i])  # type: ignore[arg-type]
        chunks: list[np.ndarray | None] = [bufs[i][a:b] for a, b in layout]
        services[i].mailbox.expect(ex.checker(op), ex.receives(op, schedule, chunks))
        out: list[np.ndarray | None] | None = (
            [outs[i][a:b] for a, b in layout] if out_of_place else None)
        await ex.run(op, schedule, chunks, out=out)

    async def every_node() -> None:
        await asyncio.wait_for(asyncio.gather(*(node(i) for i in range(world))), 20)

    asyncio.run(every_node())
    return outs if out_of_place else bufs


def _op(reduce_op: ReduceOp, x: np.ndarray) -> GlobalOp:
    now = time.monotonic()
    return GlobalOp(seq=1, kind=OpKind.ALL_REDUCE, reduce_op=reduce_op, dtype=str(x.dtype),
                    shape=x.shape, root=-1, deadline=now + 20, started=now)


def _inputs(world: int, size: int, dtype: str = "float32") -> list[np.ndarray]:
    rng = np.random.default_rng(size * 31 + world)
    inputs = [rng.standard_normal(size).astype(dtype) for _ in range(world)]
    for x in inputs:
        x.flags.writeable = False  # the walk must never write its input
    return inputs


STRATEGIES: list[Strategy] = [Ring(), Tree(2), Tree(3), Centralized()]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.spec)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("part_bytes", [PART_BYTES, 40])
def test_executor_out_of_place_matches_in_place_bitwise(
    monkeypatch: pytest.MonkeyPatch, strategy: Strategy, world: int, part_bytes: int,
) -> None:
    """Tiny parts take the pipelined walk, where a chunk is forwarded while still received."""
    monkeypatch.setattr(executor_module, "PART_BYTES", part_bytes)
    schedule = strategy.all_reduce(world)
    for size in (0, 1, world + 1, 1001):
        for reduce_op, ref_fn in ((ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max)):
            inputs = _inputs(world, size)
            kept = [x.copy() for x in inputs]
            op = _op(reduce_op, inputs[0])
            in_place = _walk(schedule, op, inputs, out_of_place=False)
            out = _walk(schedule, op, inputs, out_of_place=True)
            ref = ref_fn(np.stack([x.astype(np.float64) for x in inputs]), axis=0)
            for node in range(world):
                np.testing.assert_array_equal(inputs[node], kept[node])
                assert out[node].tobytes() == in_place[node].tobytes(), (node, size)
                assert out[node].tobytes() == out[0].tobytes(), (node, size)
                np.testing.assert_allclose(out[node], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.spec)
def test_executor_copies_the_chunks_a_node_never_writes(
    monkeypatch: pytest.MonkeyPatch, strategy: Strategy,
) -> None:
    """A reduce schedule leaves the leaves' chunks unwritten: ``out`` must still hold them
    (and every node's ``out`` must equal its in-place buffer)."""
    monkeypatch.setattr(executor_module, "PART_BYTES", 40)
    world = 3
    schedule = strategy.reduce(world, 1)
    inputs = _inputs(world, 257)
    op = _op(ReduceOp.SUM, inputs[0])
    in_place = _walk(schedule, op, inputs, out_of_place=False)
    out = _walk(schedule, op, inputs, out_of_place=True)
    for node in range(world):
        assert out[node].tobytes() == in_place[node].tobytes(), node


def test_out_must_be_a_separate_writable_array_like_the_input() -> None:
    buf = np.zeros(8, np.float32)
    require_separate_out(buf, np.empty(8, np.float32))
    for bad in (np.empty(8, np.float64), np.empty(7, np.float32), np.empty((2, 4), np.float32),
                np.empty(16, np.float32)[::2], buf, buf.view()):
        with pytest.raises(ValueError):
            require_separate_out(buf, bad)
    frozen = np.empty(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        require_separate_out(buf, frozen)


# -- real node processes --------------------------------------------------------------------

#: Element counts (float32 unless said): one element; fewer than the nodes; not divisible by
#: 2 or 3; just over one part (PART_BYTES = 1 Mi float32); chunks of two or three parts
#: (the ring's chunks with 2 nodes, the one chunk of tree and centralized). The executor tests
#: above cover many parts per chunk, with tiny parts.
SIZES = [1, 2, 1001, (1 << 20) + 1, 5 * (1 << 19) + 3]
OPS = ["sum", "max", "mean"]


def _case_input(pid: int, size: int, op: str, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([pid, size, OPS.index(op)])
    return (rng.random(size, dtype=np.float32) - 0.5).astype(dtype_from_name(dtype))


def _cases() -> list[tuple[int, str, str, bool]]:
    """(size, op, dtype, read-only input) of every all-reduce a peer runs, in order."""
    cases = [(size, op, "float32", k % 2 == 1) for k, (size, op) in enumerate(
        (size, op) for size in SIZES for op in OPS)]
    cases += [(3 * (1 << 19) + 1, "sum", "float64", False), (1 << 20, "max", "bfloat16", True)]
    return cases


def _check_result(r: np.ndarray, world: int, size: int, op: str, dtype: str) -> None:
    every = np.stack([_case_input(p, size, op, dtype).astype(np.float64) for p in range(world)])
    ref = {"sum": np.sum, "max": np.max, "mean": np.mean}[op](every, axis=0)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(r.astype(np.float64), ref, rtol=tol, atol=tol,
                               err_msg=f"{op} of {size} {dtype}")


def _run_peer(pid: int, local: int, world: int, cfg: burncoll.CollectiveConfig
              ) -> dict[str, Any]:
    """Run every case as peer ``pid``; peer 0 checks it against a float64 reference."""
    comm = burncoll.register(pid, local, cfg)
    link = comm._server.link  # internal: which composition runs
    digests = []
    try:
        for size, op, dtype, read_only in _cases():
            x = _case_input(pid, size, op, dtype)
            x.flags.writeable = not read_only
            kept = x.copy()
            r = comm.all_reduce(x, op=op)
            if not np.array_equal(x, kept):
                raise AssertionError(f"{op} of {size} {dtype} modified its input")
            if np.shares_memory(r, x):
                raise AssertionError(f"{op} of {size} {dtype}: the result aliases the input")
            if pid == 0:  # the others' digests must match this one's
                _check_result(r, world, size, op, dtype)
            digests.append(hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest())
        # a subclass whose reshape keeps two dimensions, with and without out=
        m = np.asmatrix(np.arange(6.0).reshape(2, 3) * (pid + 1))
        want = np.arange(6.0).reshape(2, 3) * sum(range(1, world + 1))
        out = np.asmatrix(np.zeros((2, 3)))
        for r in (comm.all_reduce(m), comm.all_reduce(m, out=out)):
            if not np.array_equal(np.asarray(r), want):
                raise AssertionError(f"np.matrix all-reduce: {r} instead of {want}")
    finally:
        comm.finish()
    return {"peer": pid, "ok": True, "sharded": link is not None and link.sharded,
            "digests": digests}


def _count_copies() -> list[int]:
    """Count every ``NumpyBackend.copy`` of this process (in the returned list's one item)."""
    from burncoll.backends.numpy import NumpyBackend

    count = [0]
    real_copy = NumpyBackend.copy

    def counting_copy(self: NumpyBackend, x: Any, out: Any = None) -> Any:
        count[0] += 1
        return real_copy(self, x, out)

    NumpyBackend.copy = counting_copy  # type: ignore[method-assign]
    return count


def _node_main(argv: list[str]) -> None:
    """``NODE DEVICES ORCH_ADDRESS LOCAL GLOBAL TRANSPORT`` (``DEVICES`` of every node, comma
    separated): print one JSON record per peer of this node."""
    node, devices = int(argv[0]), [int(d) for d in argv[1].split(",")]
    address, local_s, global_s, transport = argv[2:6]
    cfg = burncoll.CollectiveConfig(
        num_devices=devices[node], num_nodes=len(devices), global_address=address,
        node_address="127.0.0.1", data_service_port=0, transport=transport, timeout=20.0,
        local_all_reduce_strategy=local_s, global_all_reduce_strategy=global_s,
    )
    copies = _count_copies()
    first = sum(devices[:node])
    records: list[dict[str, Any]] = [{} for _ in range(devices[node])]

    def peer(i: int) -> None:
        try:
            records[i] = _run_peer(first + i, i, sum(devices), cfg)
        except (burncoll.CollectiveError, AssertionError) as exc:
            records[i] = {"peer": first + i, "ok": False, "error": type(exc).__name__,
                          "message": str(exc)}

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(devices[node])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for record in records:
        print(json.dumps({**record, "node": node, "copies": copies[0]}), flush=True)


def _run_nodes(devices: list[int], local_s: str, global_s: str, transport: str
               ) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    layout = ",".join(str(d) for d in devices)
    with burncoll.start_orchestrator(transport=transport) as orch:
        procs = [
            forked.start(__file__, str(n), layout, orch.address, local_s, global_s, transport,
                         stdout=forked.PIPE, stderr=forked.PIPE, env=env)
            for n in range(len(devices))
        ]
        records = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            records.extend(json.loads(line) for line in stdout.splitlines()
                           if line.startswith("{"))
            if p.returncode != 0:
                raise AssertionError(f"node exited {p.returncode}: {stderr[-2000:]}")
    return records


@pytest.mark.parametrize(("devices", "local_s", "global_s", "transport"), [
    ([1, 1], "tree", "ring", "tcp"),
    ([1, 1, 1], "ring", "ring", "tcp"),  # a local ring everywhere: the sharded composition
    ([1, 1], "tree", "tree", "websocket"),
    ([1, 1, 1], "tree", "tree", "tcp"),
    ([1, 1], "tree", "centralized", "tcp"),
    ([1, 1, 1], "tree", "centralized", "quic"),
    ([1, 2], "tree", "ring", "tcp"),  # beside a node that reduces two local peers first
    ([1, 1], "auto", "auto", "tcp"),  # small ones too: a single peer never runs inline
    ([1, 2], "auto", "auto", "tcp"),  # beside a node that runs them inline
])
def test_a_single_local_device_all_reduces_its_input_without_copying_it(
    devices: list[int], local_s: str, global_s: str, transport: str,
) -> None:
    records = _run_nodes(devices, local_s, global_s, transport)
    assert len(records) == sum(devices), records
    for r in records:
        assert r["ok"], r
        assert r["sharded"] == (local_s == "ring"), r
        if devices[r["node"]] == 1:
            assert r["copies"] == 0, r  # neither the input nor the result was copied
        assert r["digests"] == records[0]["digests"], "peers got different bits"


if __name__ == "__main__":
    _node_main(sys.argv[1:])
