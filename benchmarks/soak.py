"""Soak: thousands of back-to-back random collectives across real node processes, each checked.

    python benchmarks/soak.py                       # 10,000 operations, 3 nodes x 2 devices
    python benchmarks/soak.py --ops 300 --json out.json

Starts an orchestrator and ``--nodes`` node processes (this file with ``--node``), each with
``--devices`` peer threads on the public API. Every peer runs the same pseudo-random sequence
of operations (all_reduce, reduce, broadcast, reduce_scatter, all_gather, barrier) with random
reduce ops (sum, mean, max, min, prod), dtypes (float32, float64, int32, int64), shapes (1-D and
2-D), roots, and payloads from 0 to ``--max-bytes`` bytes (log-uniform, with 0 and the maximum
drawn on purpose). Every result is checked against a float64 reference computed from every
peer's input: exactly (the values are small binary fractions, so sums, products, maxima and
minima are exact in any order), or within two ulps for ``mean``. Inputs are checked unmodified.

Each node samples its resident memory (``VmRSS`` from ``/proc/self/status``) every 1 % of the
operations. Growth compares the highest reading of the last 10 % with the highest of operations
10-20 % (the allocator settles during the first ones, and a single reading swings with the
buffers in flight); the growth over the second half (operations 40-50 % against the last
10 %) is reported too. With glibc's default allocator, RSS follows the heap's high-water mark,
which the rarer combinations of large buffers keep raising for a while: a leak shows as growth
that goes on over the second half, and as growth with small payloads (``--max-bytes 256``).
The summary gives operations per second, failures (wrong results or errors; must be 0) and the
memory growth per node (target below 10 %). Exit status: 0 when there were no failures and the
growth is below ``--max-rss-growth``; 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import burncoll

KINDS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "barrier")
#: Relative frequencies of KINDS.
KIND_WEIGHTS = (0.40, 0.12, 0.12, 0.14, 0.14, 0.08)
REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
DTYPES = ("float32", "float64", "int32", "int64")


@dataclass(frozen=True)
class OpSpec:
    """One operation of the sequence; the same on every peer (drawn from the seed)."""

    index: int
    kind: str
    op: str
    dtype: str
    rows: int
    cols: int  # 0 = a 1-D array of ``rows`` elements
    root: int

    def shape(self, rows: int | None = None) -> tuple[int, ...]:
        r = self.rows if rows is None else rows
        return (r,) if self.cols == 0 else (r, self.cols)


def draw(seed: int, index: int, peer_ids: list[int], max_bytes: int) -> OpSpec:
    """The ``index``-th operation of the sequence of ``seed``."""
    rng = np.random.default_rng([seed, index])
    kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
    dtype = str(rng.choice(DTYPES))
    itemsize = np.dtype(dtype).itemsize
    u = rng.random()
    if u < 0.05:
        nbytes = 0
    elif u < 0.08:
        nbytes = max_bytes
    else:  # log-uniform between one element and the maximum
        nbytes = int(math.exp(rng.uniform(math.log(itemsize), math.log(max_bytes))))
    count = nbytes // itemsize
    cols = 0 if rng.random() < 0.5 else int(rng.integers(1, 17))
    rows = count if cols == 0 else count // cols
    return OpSpec(
        index, kind, str(rng.choice(REDUCE_OPS)), dtype, rows, cols, int(rng.choice(peer_ids))
    )


def _values(spec: OpSpec, shape: tuple[int, ...], peer: int) -> np.ndarray:
    """Peer ``peer``'s input: small multiples of 1/4, different per element and per peer."""
    count = math.prod(shape)
    base = np.arange(count, dtype=np.int64) * 7 + spec.index * 3 + peer * 5
    ints = base % 9 - 4  # -4 .. 4, so a product over 8 peers stays exact even in float32
    if spec.dtype.startswith("int"):
        return ints.astype(spec.dtype).reshape(shape)
    # quarters only where a product cannot lose precision (sums and extrema stay exact)
    scale = 1.0 if spec.op == "prod" else 0.25
    return (ints * scale).astype(spec.dtype).reshape(shape)


def gather_rows(spec: OpSpec, peer: int) -> int:
    """all_gather: each peer passes its own number of rows (some pass none)."""
    return max(0, spec.rows // 4 + (peer % 3) - 1)


def input_of(spec: OpSpec, peer: int) -> np.ndarray:
    if spec.kind == "all_gather":
        return _values(spec, spec.shape(gather_rows(spec, peer)), peer)
    return _values(spec, spec.shape(), peer)


_NP_REDUCE: dict[str, Any] = {
    "sum": np.sum,
    "mean": np.sum,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
}


def reference(spec: OpSpec, peer_ids: tuple[int, ...]) -> np.ndarray | None:
    """The expected full result in float64 (per-peer slicing happens in :func:`check`)."""
    if spec.kind == "barrier":
        return None
    if spec.kind == "broadcast":
        return input_of(spec, spec.root).astype(np.float64)
    if spec.kind == "all_gather":
        return np.concatenate([input_of(spec, p).astype(np.float64) for p in peer_ids])
    stack = np.stack([input_of(spec, p).astype(np.float64) for p in peer_ids])
    out = _NP_REDUCE[spec.op](stack, axis=0)
    if spec.op == "mean":
        out = out / len(peer_ids)
    return np.asarray(out, dtype=np.float64)


def result_dtype(spec: OpSpec) -> str:
    if (
        spec.op == "mean"
        and spec.kind in ("all_reduce", "reduce", "reduce_scatter")
        and (spec.dtype.startswith("int"))
    ):
        return "float64"
    return spec.dtype


def check(
    spec: OpSpec, comm: burncoll.Communicator, got: Any, full: np.ndarray | None
) -> str | None:
    """``None`` when ``got`` is right for this peer, else what is wrong."""
    if spec.kind == "barrier":
        return None if got is None else f"barrier returned {type(got).__name__}"
    if spec.kind == "reduce" and comm.peer_id != spec.root:
        return None if got is None else "reduce returned an array on a non-root peer"
    if full is None:  # pragma: no cover - only barriers have no reference
        return "no reference"
    expected = full
    if spec.kind == "reduce_scatter":
        expected = np.array_split(full, comm.world_size)[comm.rank]
    if not isinstance(got, np.ndarray):
        return f"expected an ndarray, got {type(got).__name__}"
    want_dtype = spec.dtype if spec.kind in ("broadcast", "all_gather") else result_dtype(spec)
    if str(got.dtype) != want_dtype:
        return f"dtype {got.dtype}, expected {want_dtype}"
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    g = got.astype(np.float64)
    if spec.op == "mean" and spec.kind in ("all_reduce", "reduce", "reduce_scatter"):
        eps = float(np.finfo(got.dtype).eps) if got.dtype.kind == "f" else 0.0
        bad = np.abs(g - expected) > 2 * eps * np.abs(expected) + 1e-300
    else:
        bad = g != expected
    if np.any(bad):
        where = int(np.argmax(bad.reshape(-1)))
        return (
            f"{int(bad.sum())} wrong element(s); first at flat index {where}: got "
            f"{g.reshape(-1)[where]!r}, expected {expected.reshape(-1)[where]!r}"
        )
    return None


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0  # pragma: no cover - not Linux


def run(spec: OpSpec, comm: burncoll.Communicator) -> Any:
    pid = comm.peer_id
    x = input_of(spec, pid) if spec.kind != "barrier" else None
    if spec.kind == "all_reduce":
        got = comm.all_reduce(x, op=spec.op)
    elif spec.kind == "reduce":
        got = comm.reduce(x, root=spec.root, op=spec.op)
    elif spec.kind == "broadcast":
        # receivers pass None or an array like the root's, alternately
        mine = x if pid == spec.root or (spec.index + pid) % 2 else None
        got = comm.broadcast(mine, root=spec.root)
    elif spec.kind == "reduce_scatter":
        got = comm.reduce_scatter(x, op=spec.op)
    elif spec.kind == "all_gather":
        got = comm.all_gather(x)
    else:
        comm.barrier()
        got = None
    if x is not None and not np.array_equal(x, input_of(spec, pid)):
        raise AssertionError(f"{spec.kind} #{spec.index} modified its input")
    return got


# -- one node ---------------------------------------------------------------------------------


def node_main(args: argparse.Namespace) -> int:
    devices, nodes = args.devices, args.nodes
    world = nodes * devices
    peer_ids = list(range(world))
    config = burncoll.CollectiveConfig(
        num_devices=devices,
        num_nodes=nodes,
        global_address=args.address,
        node_address="127.0.0.1",
        data_service_port=0,
        transport=args.transport,
        timeout=args.timeout,
        local_all_reduce_strategy=args.local,
        local_reduce_strategy=args.local,
        local_broadcast_strategy=args.local,
        global_all_reduce_strategy=args.global_,
        global_reduce_strategy=args.global_,
        global_broadcast_strategy=args.global_,
    )
    specs = functools.lru_cache(maxsize=8)(lambda i: draw(args.seed, i, peer_ids, args.max_bytes))
    ref_lock = threading.Lock()
    refs: dict[int, tuple[int, np.ndarray | None]] = {}

    def shared_reference(spec: OpSpec) -> np.ndarray | None:
        # computed once per node, dropped when every local peer has used it
        with ref_lock:
            entry = refs.get(spec.index)
            if entry is None:
                entry = (0, reference(spec, tuple(peer_ids)))
            used, full = entry
            used += 1
            if used == devices:
                refs.pop(spec.index, None)
            else:
                refs[spec.index] = (used, full)
            return full

    report: dict[str, Any] = {"node": args.node, "ops": 0, "wrong": [], "error": None, "bytes": 0}
    samples: list[tuple[int, int]] = []
    sample_every = max(args.ops // 100, 1)
    barrier = threading.Barrier(devices)

    def peer(local: int) -> None:
        pid = args.node * devices + local
        try:
            comm = burncoll.register(pid, local, config)
        except burncoll.CollectiveError as exc:
            report["error"] = f"register: {type(exc).__name__}: {exc}"
            return
        try:
            for i in range(args.ops):
                if local == 0 and i % sample_every == 0:
                    samples.append((i, rss_kib()))
                spec = specs(i)
                got = run(spec, comm)
                problem = check(spec, comm, got, shared_reference(spec))
                if problem is not None:
                    report["wrong"].append(f"peer {pid}: {spec}: {problem}")
                if local == 0:
                    report["ops"] = i + 1
                    report["bytes"] += spec.rows * max(spec.cols, 1) * np.dtype(spec.dtype).itemsize
            barrier.wait(args.timeout)
            if local == 0:
                samples.append((args.ops, rss_kib()))
            comm.finish()
        except (burncoll.CollectiveError, AssertionError) as exc:
            if report["error"] is None:
                report["error"] = f"peer {pid}: {type(exc).__name__}: {exc}"
            barrier.abort()

    started = time.monotonic()
    threads = [threading.Thread(target=peer, args=(i,)) for i in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["seconds"] = time.monotonic() - started
    # Resident memory swings with the buffers in flight when it is read, so compare the
    # highest reading after the warm-up (operations 10-20 %) with the highest at the end (the
    # last 10 %): a leak raises the second; the allocator settling during warm-up does not.
    warm = [kib for i, kib in samples if args.ops * 0.1 <= i < args.ops * 0.2]
    end = [kib for i, kib in samples if i >= args.ops * 0.9]
    # The same over the second half (40-50 % -> last 10 %): what is left once the allocator's
    # high-water mark has been reached by the rarer combinations of large buffers.
    mid = [kib for i, kib in samples if args.ops * 0.4 <= i < args.ops * 0.5]
    report["rss_warm_kib"] = max(warm, default=0)
    report["rss_mid_kib"] = max(mid, default=0)
    report["rss_end_kib"] = max(end, default=0)
    report["rss_samples_kib"] = samples
    print(json.dumps(report), flush=True)
    return 0


# -- the driver -------------------------------------------------------------------------------


def soak(
    ops: int,
    nodes: int = 3,
    devices: int = 2,
    transport: str = "websocket",
    max_bytes: int = 4 << 20,
    seed: int = 0,
    timeout: float = 60.0,
    local: str = "tree",
    global_: str = "ring",
) -> dict[str, Any]:
    """Run the soak; returns the summary (also what ``--json`` writes)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    started = time.monotonic()
    with burncoll.start_orchestrator(transport=transport) as orch:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--node",
                    str(n),
                    "--address",
                    orch.address,
                    "--nodes",
                    str(nodes),
                    "--devices",
                    str(devices),
                    "--transport",
                    transport,
                    "--ops",
                    str(ops),
                    "--max-bytes",
                    str(max_bytes),
                    "--seed",
                    str(seed),
                    "--timeout",
                    str(timeout),
                    "--local",
                    local,
                    "--global",
                    global_,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for n in range(nodes)
        ]
        reports: list[dict[str, Any]] = []
        problems: list[str] = []
        for n, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout * 3 + ops * 2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                problems.append(f"node {n} hung")
            lines = [json.loads(s) for s in out.splitlines() if s.startswith("{")]
            if not lines:
                problems.append(f"node {n} exited {p.returncode} without a report: {err[-1500:]}")
            reports.extend(lines)
    wall = time.monotonic() - started
    growth = []
    for r in reports:
        if r.get("error"):
            problems.append(f"node {r['node']}: {r['error']}")
        problems.extend(r.get("wrong", [])[:20])
        if r["rss_warm_kib"] and r["rss_end_kib"]:
            growth.append((r["rss_end_kib"] - r["rss_warm_kib"]) / r["rss_warm_kib"])
    seconds = max((r["seconds"] for r in reports), default=wall)
    done = min((r["ops"] for r in reports), default=0)
    return {
        "ops": ops,
        "completed": done,
        "nodes": nodes,
        "devices": devices,
        "transport": transport,
        "strategies": f"{local}/{global_}",
        "seed": seed,
        "max_bytes": max_bytes,
        "seconds": round(seconds, 2),
        "ops_per_s": round(done / seconds, 1) if seconds else 0.0,
        "payload_mib": round(sum(r["bytes"] for r in reports[:1]) / 2**20, 1),
        "failures": len(problems) + (ops - done if not problems else 0),
        "problems": problems[:20],
        "rss_kib": [
            (r["node"], r["rss_warm_kib"], r["rss_mid_kib"], r["rss_end_kib"]) for r in reports
        ],
        "rss_growth_max": round(max(growth, default=0.0), 4),
        "rss_samples_kib": {r["node"]: r["rss_samples_kib"] for r in reports},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--transport", choices=("websocket", "quic"), default="websocket")
    parser.add_argument("--max-bytes", type=int, default=4 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--local", default="tree", help="local strategy (every operation)")
    parser.add_argument(
        "--global", dest="global_", default="ring", help="global strategy (every operation)"
    )
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="fail when a node's resident memory grows more (default 0.10)",
    )
    parser.add_argument("--json", default=None, help="write the summary to this file")
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node is not None:
        return node_main(args)
    print(
        f"# soak: {args.ops} operations, {args.nodes} nodes x {args.devices} devices, "
        f"{args.transport}, {args.local}/{args.global_}, payloads 0..{args.max_bytes} B, "
        f"seed {args.seed}",
        flush=True,
    )
    summary = soak(
        args.ops,
        args.nodes,
        args.devices,
        args.transport,
        args.max_bytes,
        args.seed,
        args.timeout,
        args.local,
        args.global_,
    )
    print(
        f"completed {summary['completed']}/{summary['ops']} operations in "
        f"{summary['seconds']} s: {summary['ops_per_s']} ops/s, "
        f"{summary['payload_mib']} MiB of input per peer"
    )
    print(f"failures: {summary['failures']}")
    for problem in summary["problems"]:
        print(f"  {problem}")
    for node, warm, mid, end in summary["rss_kib"]:
        growth = (end - warm) / warm * 100 if warm else float("nan")
        second = (end - mid) / mid * 100 if mid else float("nan")
        print(
            f"node {node}: VmRSS {warm / 1024:.1f} MiB after warm-up (10-20 %) -> "
            f"{end / 1024:.1f} MiB at the end ({growth:+.1f} %; {second:+.1f} % over the "
            "second half)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    ok = summary["failures"] == 0 and summary["rss_growth_max"] < args.max_rss_growth
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
