"""The one-round exchange for small global all-reduces (``burncoll.node.exchange``).

Under the ``auto`` global strategy an all-reduce of at most ``exchange_limit(num_nodes,
one_host)`` bytes per node is sent by every node to every other node, and each node reduces
the buffers in node order (``x0 op x1 op ... op x(n-1)``): the same bits on every node. Larger
ones run the ring. Mismatched calls between nodes raise a ``MismatchError`` on every peer, as
with the schedules -- or, on a peer that calls only after its node has learnt of the mismatch from
another node, the ``CollectiveAborted`` (caused by it) that every later call raises.

Two levels: :func:`exchange_all_reduce` (the event loop's driver of the exchange's core)
alone, several nodes in one event loop over the
in-memory data service of ``test_out_of_place`` (every dtype and op, exact node order,
mismatches, a malformed buffer); and real node processes through an orchestrator (tcp,
websocket, quic), where ``all_reduce`` (with and without ``out=``) takes the exchange up to the
limit and the ring just above it. Run as a script, this file is one node process of the second
level (see :func:`_node_main`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.dtypes import dtype_from_name
from burncoll.levels import GlobalOp
from burncoll.node.exchange import ExchangeCores, exchange_all_reduce, exchange_receives
from burncoll.node.executor import GlobalExecutor
from burncoll.ops import OpKind, parse_reduce_op
from burncoll.strategies.auto import exchange_limit
from burncoll.strategies.layout import even_layout
from burncoll.transport.host_files import host_identity
from tests import forked
from tests.node.test_out_of_place import _MemoryService


def _limit(nodes: int, transport: str = "tcp", lanes: bool | None = None) -> int:
    """The exchange limit these tests' node processes (all of this host) choose by: lower
    where shared segments take over past it, with caller sockets (``lanes``; ``None``: as
    this process's environment says)."""
    one_host = bool(host_identity()) and burncoll.CollectiveConfig().shared_memory
    config = burncoll.CollectiveConfig(transport=transport) if lanes is None else (
        burncoll.CollectiveConfig(transport=transport, caller_sockets=lanes))
    return exchange_limit(nodes, one_host, config.uses_lanes)


REPO = Path(__file__).resolve().parents[2]
_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}


def _values(seed: Any, count: int, dtype: str) -> np.ndarray:
    """Deterministic test data: small integers, or floats in [-2, 2)."""
    rng = np.random.default_rng(seed)
    if "int" in dtype:
        low = 0 if dtype.startswith("u") else -3
        return rng.integers(low, 4, size=count).astype(dtype_from_name(dtype))
    return rng.uniform(-2, 2, size=count).astype(dtype_from_name(dtype))


def _fold(xs: list[np.ndarray], op: str) -> np.ndarray:
    """``x0 op x1 op ... op x(n-1)`` in the arrays' dtype."""
    folded: np.ndarray = functools.reduce(_UFUNC[op], xs)
    return folded


# -- the exchange alone, over an in-memory data service ---------------------------------------


class _Service(_MemoryService):
    timeout = 5.0  # named in timeout messages


#: The operations' timeout, unless a test gives another.
TIMEOUT = 10.0


def _op(reduce_op: str, x: np.ndarray, timeout: float = TIMEOUT) -> GlobalOp:
    now = time.monotonic()
    return GlobalOp(seq=3, kind=OpKind.ALL_REDUCE, reduce_op=parse_reduce_op(reduce_op),
                    dtype=x.dtype.name, shape=x.shape, root=-1, deadline=now + timeout,
                    started=now)


def _exchange(bufs: list[np.ndarray], ops: list[GlobalOp],
              sizes: list[int] | None = None) -> list[np.ndarray | BaseException]:
    """Every node's ``out`` after :func:`exchange_all_reduce`, or the error it raised.

    ``ops[i]`` is node ``i``'s call; ``sizes`` gives a node a buffer length other than its
    call's (a malformed sender)."""
    world = len(bufs)
    services: list[_MemoryService] = [_Service(i, world) for i in range(world)]
    for s in services:
        s.others = services
    outs = [np.full(b.shape, 77, b.dtype) for b in bufs]
    if sizes is not None:
        bufs = [b if n == b.size else np.resize(b, n) for b, n in zip(bufs, sizes, strict=True)]

    async def node(i: int) -> np.ndarray:
        ex = GlobalExecutor(services[i])  # type: ignore[arg-type]
        receives = exchange_receives(services[i], ops[i], bufs[i], 1)  # type: ignore[arg-type]
        services[i].mailbox.expect(ex.checker(ops[i]), receives)
        try:
            core = ExchangeCores(ex).of(ops[i], bufs[i].nbytes, 1)
            await exchange_all_reduce(ex, core, ops[i], bufs[i], outs[i])
        finally:
            services[i].mailbox.done(ops[i].seq)
        return outs[i]

    async def every_node() -> list[np.ndarray | BaseException]:
        return await asyncio.wait_for(
            asyncio.gather(*(node(i) for i in range(world)), return_exceptions=True), 20)

    return asyncio.run(every_node())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32",
                                   "uint8"])
def test_exchange_reduces_in_node_order_on_every_node(world: int, dtype: str) -> None:
    for count in (0, 1, 7, 1001):
        for name in ("sum", "max", "min", "prod"):
            bufs = [_values([world, count, node], count, dtype) for node in range(world)]
            for b in bufs:
                b.flags.writeable = False  # the exchange only reads its buffer
            kept = [b.copy() for b in bufs]
            outs = _exchange(bufs, [_op(name, b) for b in bufs])
            expected = _fold(kept, name)
            for node, out in enumerate(outs):
                assert isinstance(out, np.ndarray), out
                assert out.dtype == bufs[0].dtype
                assert out.tobytes() == expected.tobytes(), (node, name, count)
                np.testing.assert_array_equal(bufs[node], kept[node])
            if name == "sum" and "float" not in dtype:
                ref = np.sum(np.stack([b.astype(np.float64) for b in kept]), axis=0)
                np.testing.assert_array_equal(outs[0], ref.astype(dtype))


def test_the_order_is_the_nodes_not_mine_first() -> None:
    """float32 addition is not associative: (1e8 + 1) - 1e8 is 0, 1e8 - 1e8 + 1 is 1. Every
    node must compute the first, whichever node it is."""
    bufs = [np.array([1e8], np.float32), np.array([1.0], np.float32),
            np.array([-1e8], np.float32)]
    outs = _exchange(bufs, [_op("sum", b) for b in bufs])
    assert [float(o[0]) for o in outs] == [0.0, 0.0, 0.0]  # type: ignore[index]
    bufs = bufs[::-1]  # -1e8 + 1 is -1e8 in float32, + 1e8 is 0: still every node alike
    outs = _exchange(bufs, [_op("sum", b) for b in bufs])
    assert [float(o[0]) for o in outs] == [0.0, 0.0, 0.0]  # type: ignore[index]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("what", ["shape", "dtype", "op"])
def test_mismatch_is_raised_on_every_node(world: int, what: str) -> None:
    bufs = [np.ones(4) for _ in range(world)]
    ops = [_op("sum", b) for b in bufs]
    odd = world - 1
    if what == "shape":
        bufs[odd] = np.ones(5)
    elif what == "dtype":
        bufs[odd] = np.ones(4, np.float32)
    ops[odd] = _op("max" if what == "op" else "sum", bufs[odd])
    started = time.monotonic()
    outs = _exchange(bufs, ops)
    assert time.monotonic() - started < TIMEOUT / 2, "a mismatch must not wait for the timeout"
    mine = {"shape": "float64[5]", "dtype": "float32[4]", "op": "op=max"}[what]
    theirs = "op=sum" if what == "op" else "float64[4]"
    for out in outs:
        assert isinstance(out, burncoll.MismatchError), out
        assert mine in str(out) and theirs in str(out), out


def test_a_buffer_of_the_wrong_size_is_a_protocol_error() -> None:
    """Node 1 announces float64[4] but sends 5 elements: node 0 refuses it."""
    bufs = [np.ones(4), np.ones(4)]
    outs = _exchange(bufs, [_op("sum", b) for b in bufs], sizes=[4, 5])
    assert isinstance(outs[0], burncoll.ProtocolError), outs[0]
    # refused on arrival: the exchange receives one part of exactly its own buffer's size
    assert "where this node expects" in str(outs[0]), outs[0]


MISSING_TIMEOUT = 0.5


def test_a_missing_node_times_out_naming_it() -> None:
    """Node 2 never calls: nodes 0 and 1 raise a timeout that names it, by the deadline."""
    world = 3
    services: list[_MemoryService] = [_Service(i, world) for i in range(world)]
    for s in services:
        s.others = services
    x = np.ones(3)

    async def node(i: int) -> None:
        ex = GlobalExecutor(services[i])  # type: ignore[arg-type]
        op = _op("sum", x, timeout=MISSING_TIMEOUT)
        receives = exchange_receives(services[i], op, x, 0)  # type: ignore[arg-type]
        services[i].mailbox.expect(ex.checker(op), receives)
        await exchange_all_reduce(ex, ExchangeCores(ex).of(op, x.nbytes), op, x,
                                  np.empty_like(x))

    async def two_nodes() -> list[Any]:
        return list(await asyncio.gather(node(0), node(1), return_exceptions=True))

    started = time.monotonic()
    errors = asyncio.run(two_nodes())
    assert time.monotonic() - started < 10 * MISSING_TIMEOUT  # by the deadline, not never
    for e in errors:
        assert isinstance(e, burncoll.CollectiveTimeout), e
        assert "node 2" in str(e)


# -- real node processes -------------------------------------------------------------------

#: (element count, op, dtype, out) of every all-reduce; ``out`` is None, "in_place" or
#: "separate". Counts are relative to the exchange limit: -1 is the limit itself (in bytes:
#: the largest exchanged array), -2 the limit plus one element (the smallest that is not),
#: -3 the limit less one element.
_OPS = ("sum", "max", "mean", "prod")
_DTYPES = ("float32", "float64", "int32")


def _cases() -> list[tuple[int, str, str, str | None]]:
    cases: list[tuple[int, str, str, str | None]] = []
    for k, (op, dtype) in enumerate((op, dtype) for op in _OPS for dtype in _DTYPES):
        sizes = [1, 3, 1001, -1 if k % 2 == 0 else -2]
        cases += [(size, op, dtype, None) for size in sizes]
    cases += [(0, "sum", "float32", None), (1, "min", "float64", None), (-2, "sum", "int32", None),
              (-1, "max", "float64", None), (-3, "sum", "float64", None),
              (-3, "max", "int32", "in_place")]
    for out in ("in_place", "separate"):
        for size in (1, 1001, -1, -2):
            cases += [(size, "sum", "float32", out), (size, "mean", "float64", out)]
        cases += [(7, "max", "int32", out), (-1, "prod", "float32", out)]
    return cases


def _count(size: int, dtype: str, nodes: int, transport: str, lanes: bool | None = None
           ) -> int:
    itemsize = dtype_from_name(dtype).itemsize
    limit = _limit(nodes, transport, lanes) // itemsize
    return {-1: limit, -2: limit + 1, -3: limit - 1}.get(size, size)


def _input(pid: int, k: int, count: int, dtype: str) -> np.ndarray:
    return _values([pid, k], count, dtype)


def _expected(k: int, count: int, op: str, dtype: str, layout: list[int]
              ) -> tuple[np.ndarray, np.ndarray]:
    """(the exchange's exact bits: each node's peers folded in peer order, then the nodes in
    node order, a mean divided at the end; the float64 reference)."""
    partials, every = [], []
    first = 0
    for d in layout:
        xs = [_input(p, k, count, dtype) for p in range(first, first + d)]
        partials.append(_fold(xs, op))
        every += xs
        first += d
    exact = _fold(partials, op)
    if op == "mean":
        exact = np.divide(exact, len(every),
                          dtype=exact.dtype if exact.dtype.kind == "f" else np.float64)
    stack = np.stack([x.astype(np.float64) for x in every])
    reducers: dict[str, Callable[..., np.ndarray]] = {
        "sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean, "prod": np.prod}
    ref = reducers[op](stack, axis=0)
    return exact, ref


def _count_exchanges() -> list[int]:
    """Count this process's exchanges: (the returned list's first item) those on the member
    connections, through the event loop's driver, and (the second) those on the caller
    sockets or the shared mail, through the calling thread's. The wrappers only observe:
    they call the real methods."""
    from burncoll.node.lane_exchange import LaneExchange
    from burncoll.node.link import NodeLink

    count = [0, 0]
    on_connections, on_lanes = NodeLink._exchange_on_connections, LaneExchange.all_reduce

    def counting_connections(*args: Any, **kwargs: Any) -> None:
        count[0] += 1
        on_connections(*args, **kwargs)

    def counting_lanes(*args: Any, **kwargs: Any) -> None:
        count[1] += 1
        on_lanes(*args, **kwargs)

    NodeLink._exchange_on_connections = counting_connections  # type: ignore[method-assign]
    LaneExchange.all_reduce = counting_lanes  # type: ignore[method-assign]
    return count


def _run_cases(comm: burncoll.Communicator, layout: list[int], local_s: str
               ) -> dict[str, Any]:
    """Every case as this peer; the collective's first peer also checks each result against
    the float64 reference, and exchanged ones against their exact bits where the local phase
    reduces in peer order (inline under auto; any order of two peers gives the same bits).
    What is wrong is reported, not raised, so that the other peers are not left waiting."""
    pid = comm.peer_id
    nodes = len(layout)
    exact_order = local_s == "auto" or max(layout) <= 2
    digests, problems = [], []
    for k, (size, op, dtype, out_mode) in enumerate(_cases()):
        count = _count(size, dtype, nodes, comm.config.transport)
        x = _input(pid, k, count, dtype)
        kept = x.copy()
        what = f"case {k}: {op} of {count} {dtype} (out={out_mode})"
        if out_mode is None:
            r = comm.all_reduce(x, op=op)
            if np.may_share_memory(r, x):
                problems.append(f"{what}: the result aliases the input")
        else:
            out = x if out_mode == "in_place" else np.full_like(x, 99)
            r = comm.all_reduce(x, op=op, out=out)
            if r is not out:
                problems.append(f"{what}: all_reduce did not return out")
        if out_mode != "in_place" and not np.array_equal(x, kept):
            problems.append(f"{what}: the input was modified")
        if pid == 0:
            exact, ref = _expected(k, count, op, dtype, layout)
            tol = 1e-5 if dtype == "float32" else 1e-12
            if r.dtype != exact.dtype or r.shape != (count,):
                problems.append(f"{what}: got {r.dtype}{list(r.shape)}")
            elif not np.allclose(r.astype(np.float64), ref, rtol=tol, atol=tol):
                worst = float(np.max(np.abs(r.astype(np.float64) - ref)))
                problems.append(f"{what}: off the float64 reference by up to {worst:g}")
            elif (exact_order and x.nbytes <= _limit(nodes, comm.config.transport)
                    and r.tobytes() != exact.tobytes()):
                problems.append(f"{what}: not the node-order fold of the exchange")
        digests.append(hashlib.sha256(r.dtype.name.encode() + r.tobytes()).hexdigest())
    return {"digests": digests, "problems": problems}


def _mismatch(comm: burncoll.Communicator, node: int, nodes: int, what: str
              ) -> dict[str, Any]:
    """One good small all-reduce, then node 1 calls differently from the others ("late": as
    "shape", with node 0 calling half a second after the others). A node still finishing the
    good one when the others have found the mismatch may raise it there: the session failed
    (``"early"``)."""
    started = time.monotonic()
    try:
        comm.all_reduce(np.ones(4))
    except burncoll.CollectiveError as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc), "early": True,
                "cause": type(exc.__cause__).__name__, "elapsed": time.monotonic() - started}
    odd = node == 1
    x, op = np.ones(4), "sum"
    if what in ("shape", "late"):
        x = np.ones(5 if odd else 4)
    elif what == "dtype":
        x = np.ones(4, np.float32 if odd else np.float64)
    elif what == "op":
        op = "max" if odd else "sum"
    elif what == "boundary":  # the others exchange, node 1 runs the ring
        x = np.ones(_limit(nodes, comm.config.transport) // 8 + (1 if odd else 0))
    if what == "late" and node == 0:
        time.sleep(0.5)
    started = time.monotonic()
    try:
        comm.all_reduce(x, op=op)
    except burncoll.CollectiveError as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc),
                "cause": type(exc.__cause__).__name__, "elapsed": time.monotonic() - started}
    raise AssertionError("the mismatched all_reduce returned")


def _byteorder(comm: burncoll.Communicator, node: int) -> dict[str, Any]:
    """Node 0 passes big-endian arrays, the others native ones, small and large."""
    problems = []
    for count in (5, 300_000):
        x = np.arange(count, dtype=np.float32) * (node + 1)
        mine = x.astype(">f4") if node == 0 else x
        expected = np.arange(count, dtype=np.float64) * sum(
            n + 1 for n in range(comm.world_size))
        got = comm.all_reduce(mine)
        if not np.array_equal(np.asarray(got, np.float64), expected):
            problems.append(f"{count} elements: got {np.asarray(got)[:4]}")
    return {"problems": problems}


def _node_main(argv: list[str]) -> None:
    """``NODE LAYOUT ORCH_ADDRESS LOCAL TRANSPORT SCENARIO TIMEOUT`` (``LAYOUT``: the devices
    of every node, comma separated): print one JSON record per peer of this node."""
    node, layout = int(argv[0]), [int(d) for d in argv[1].split(",")]
    address, local_s, transport, scenario, timeout = argv[2], argv[3], argv[4], argv[5], float(
        argv[6])
    cfg = burncoll.CollectiveConfig(
        num_devices=layout[node], num_nodes=len(layout), global_address=address,
        node_address="127.0.0.1", data_service_port=0, transport=transport, timeout=timeout,
        local_all_reduce_strategy=local_s, global_all_reduce_strategy="auto",
    )
    exchanges = _count_exchanges()
    first = sum(layout[:node])
    records: list[dict[str, Any]] = [{} for _ in range(layout[node])]

    def peer(i: int) -> None:
        record: dict[str, Any] = {"peer": first + i, "node": node, "ok": True}
        try:
            comm = burncoll.register(first + i, i, cfg)
            try:
                if scenario == "cases":
                    record.update(_run_cases(comm, layout, local_s))
                elif scenario == "byteorder":
                    record.update(_byteorder(comm, node))
                else:
                    record.update(_mismatch(comm, node, len(layout), scenario))
            finally:
                with contextlib.suppress(burncoll.CollectiveError):  # fails after a mismatch
                    comm.finish()
        except (burncoll.CollectiveError, AssertionError) as exc:
            record.update(ok=False, error=type(exc).__name__, message=str(exc))
        records[i] = record

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(layout[node])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for record in records:
        print(json.dumps({**record, "exchanges": exchanges[0], "laned": exchanges[1]}),
              flush=True)


def _run_nodes(layout: list[int], local_s: str, transport: str, scenario: str,
               timeout: float = 20.0, lanes: bool = True) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), BURNCOLL_CALLER_SOCKETS=str(int(lanes)))
    with burncoll.start_orchestrator(transport=transport) as orch:
        procs = [
            forked.start(__file__, str(n), ",".join(map(str, layout)), orch.address, local_s,
                         transport, scenario, str(timeout), stdout=forked.PIPE,
                         stderr=forked.PIPE, env=env)
            for n in range(len(layout))
        ]
        records: list[dict[str, Any]] = []
        try:
            for p in procs:
                stdout, stderr = p.communicate(timeout=timeout * 3 + 30)
                records.extend(json.loads(line) for line in stdout.splitlines()
                               if line.startswith("{"))
                if p.returncode != 0:
                    raise AssertionError(f"node exited {p.returncode}: {stderr[-2000:]}")
        finally:
            for p in procs:
                if p.poll() is None:  # pragma: no cover - only after a failure above
                    p.kill()
                    p.wait()
    return records


@pytest.mark.parametrize(("layout", "local_s", "transport", "lanes"), [
    ([1, 1], "tree", "tcp", True),  # one device per node, out= straight into the result
    ([1, 1], "tree", "tcp", False),  # without caller sockets: the event loop's exchange
    ([1, 1], "auto", "websocket", True),  # the inline path around the global all-reduce
    ([1, 1, 1], "auto", "tcp", True),
    ([1, 1, 1], "auto", "websocket", False),
    ([1, 1, 1], "ring", "websocket", True),  # the sharded composition (one shard per node)
    ([1, 1, 1, 1], "auto", "tcp", True),  # 4 nodes of one host: the exchange up to 64 KiB
    ([2, 2], "auto", "websocket", True),
    ([2, 2], "tree", "tcp", True),
    ([2, 2], "ring", "tcp", True),  # sharded: each peer all-reduces a shard on its channel
    ([1, 2], "auto", "tcp", True),  # a single peer beside a node that reduces two first
    ([1, 1, 1], "tree", "quic", True),  # QUIC has no caller sockets
], ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)) if isinstance(
    v, list) else ("lanes" if v else "loop"))
def test_small_all_reduces_exchange_and_larger_ones_do_not(
    layout: list[int], local_s: str, transport: str, lanes: bool,
) -> None:
    records = _run_nodes(layout, local_s, transport, "cases", lanes=lanes)
    assert len(records) == sum(layout), records
    nodes = len(layout)
    shards = layout[0] if local_s == "ring" and layout[0] > 1 else 1
    exchanged = sum(1 for size, _op, dtype, _out in _cases()
                    for a, b in even_layout(_count(size, dtype, nodes, transport, lanes), shards)
                    if (b - a) * dtype_from_name(dtype).itemsize <= _limit(nodes, transport,
                                                                           lanes))
    # per node and operation: one exchange, or one per shard that fits (the sharded layout
    # halves every case, so all of them fit; the others also run the ring above the limit)
    assert exchanged > 0 and (shards > 1 or exchanged < len(_cases()))
    for r in records:
        assert r["ok"], r
        assert not r["problems"], r["problems"]
        assert r["digests"] == records[0]["digests"], f"peer {r['peer']} got different bits"
        # one per operation on each node, on the caller sockets or not
        assert r["exchanges"] + r["laned"] == exchanged, r
        if transport == "quic" or not lanes:  # the event loop's exchange, on the connections
            assert r["laned"] == 0, r
        else:  # the calling thread exchanged on its own sockets (channel 0; the other
            # channels of a sharded all-reduce on the connections)
            assert r["laned"] > 0 and (shards > 1 or r["exchanges"] == 0), r


@pytest.mark.parametrize("local_s", ["auto", "ring"])
def test_a_non_native_byte_order_input_is_converted_on_every_path(local_s: str) -> None:
    records = _run_nodes([1, 1], local_s, "tcp", "byteorder")
    assert len(records) == 2, records
    for r in records:
        assert r["ok"], r
        assert not r["problems"], r["problems"]


def _mismatch_messages(what: str, nodes: int, transport: str = "tcp") -> tuple[str, str]:
    """How node 1's call and the others' calls are described in the error."""
    return {
        "shape": ("float64[5]", "float64[4]"),
        "late": ("float64[5]", "float64[4]"),
        "dtype": ("float32[4]", "float64[4]"),
        "op": ("op=max", "op=sum"),
        "boundary": (f"float64[{_limit(nodes, transport) // 8 + 1}]",
                     f"float64[{_limit(nodes, transport) // 8}]"),
    }[what]


def _is_the_mismatch(r: dict[str, Any]) -> bool:
    """A MismatchError, or -- on a peer whose node learnt of the mismatch from another node
    before this peer called (the exchange sends at once, so that can happen without any
    delay) -- the CollectiveAborted that every later call raises, caused by it."""
    return r.get("error") == "MismatchError" or (
        r.get("error") == "CollectiveAborted" and r.get("cause") == "MismatchError")


@pytest.mark.parametrize(("what", "layout", "local_s", "transport"), [
    ("shape", [1, 1, 1], "auto", "websocket"),
    ("dtype", [2, 2], "auto", "tcp"),
    ("op", [1, 1], "tree", "tcp"),
    ("shape", [2, 2], "ring", "websocket"),  # sharded
    ("boundary", [1, 1], "auto", "websocket"),
    ("boundary", [1, 1, 1], "tree", "tcp"),
])
def test_mismatched_calls_raise_on_every_peer(what: str, layout: list[int], local_s: str,
                                              transport: str) -> None:
    # Between node processes of this host: their large messages take shared memory, whose
    # ring a failing node removes before a slow receiver maps it (its reason must still
    # reach every node: burncoll.transport.shm.RingReceiver).
    timeout = 10.0
    records = _run_nodes(layout, local_s, transport, what, timeout=timeout)
    assert len(records) == sum(layout), records
    odd, usual = _mismatch_messages(what, len(layout), transport)
    for r in records:
        assert "elapsed" in r, r  # else the good all_reduce before the mismatched one failed
        assert _is_the_mismatch(r), r  # (in the good one only as the others' mismatch)
        assert odd in r["message"] and usual in r["message"], r["message"]
        assert r["elapsed"] < timeout / 2, r  # found by comparing calls, not by a timeout
    assert any(r["error"] == "MismatchError" for r in records)


@pytest.mark.parametrize("layout", [[1, 1, 1], [2, 1, 2]])
def test_a_node_calling_after_the_mismatch_was_found_raises_at_once(layout: list[int]) -> None:
    """Nodes 1 and 2 find the mismatch between themselves; node 0 calls half a second later
    and raises at once instead of waiting for frames that will never come."""
    timeout = 10.0
    records = _run_nodes(layout, "auto", "tcp", "late", timeout=timeout)
    assert len(records) == sum(layout), records
    odd, usual = _mismatch_messages("late", len(layout))
    for r in records:
        assert _is_the_mismatch(r), r
        assert odd in r["message"] and usual in r["message"], r["message"]
        assert r["elapsed"] < timeout / 2, r  # at once, not by the timeout
        if r["node"] != 0:
            assert r["error"] == "MismatchError", r


if __name__ == "__main__":
    _node_main(sys.argv[1:])
