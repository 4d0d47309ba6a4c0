"""Overlap of gradient all-reduces with backward: a training step with and without it.

    python benchmarks/overlap.py                  # 2 nodes x 1 device, defaults below
    python benchmarks/overlap.py --layers 8 --width 1024 --batch 64 --bucket-mb 4 --runs 5
    sudo .venv/bin/python benchmarks/overlap.py --rate 1gbit   # 2 simulated hosts, 1 Gbit/s

Starts an orchestrator and ``--nodes`` node processes (this file with ``--node``, through
:func:`burncoll.orchestration.launch.launch_nodes`, as ``burncoll launch --nodes N`` does),
each with
``--devices`` peer threads training a NumPy MLP (``--layers`` dense layers of ``--width`` x
``--width``, tanh, float32, ``--batch`` examples per peer, full-batch SGD) with
``DataParallel.fit``. Backward is computed layer by layer, last layer first. Two modes, the
same model, data and ``bucket_bytes``:

* **blocking**: ``grad_fn`` returns the gradient tree; ``fit`` reduces it with one bucketed
  ``all_reduce_tree`` after backward (communication after computation);
* **overlap**: ``grad_fn`` returns a generator yielding each layer's gradients as backward
  produces them; ``fit`` hands them to ``GradientBuckets``, which issues each full bucket's
  all-reduce with ``async_op=True`` while the next layers' gradients are computed.

A step's time is the time between two of ``fit``'s per-step callbacks on rank 0 (forward,
backward, the reduction, the SGD update); a run's figure is the median over its steps after
``--warmup`` steps, each run trains both modes (alternating which goes first), and the table
shows the median over ``--runs`` runs with the range, and the median of the per-run ratios
blocking / overlap (> 1: overlap is faster). For scale, "compute only" times the same steps
with no communication, and "all_reduce_tree only" the reduction of a gradient tree alone;
the best overlap can do is the larger of the two instead of their sum. ``--rate R``: the
nodes run on simulated hosts instead (network namespaces on a bridge, each host's egress
capped at ``R`` with ``tc ... tbf``, as ``benchmarks/slow_link.py``; needs root), where
communication waits on the link rather than on the CPUs. BLAS is limited to
``--blas-threads`` threads per process (default 1), so that the nodes and their
communication threads are not starved by BLAS threads on a small machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

NDArray = np.ndarray[Any, Any]
Params = list[dict[str, NDArray]]
MODES = ("blocking", "overlap")
LR = 1e-3


# -- the model ------------------------------------------------------------------------------------
def init(layers: int, width: int, seed: int = 0) -> Params:
    """``layers`` dense layers ``width x width`` with biases, float32."""
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
             "b": np.zeros(width, np.float32)} for _ in range(layers)]


def backward(params: Params, batch: tuple[NDArray, NDArray]
             ) -> tuple[float, Iterator[tuple[Any, NDArray]]]:
    """The mean squared error of the MLP on ``batch``, and a generator computing the gradients
    layer by layer, last layer first (``((layer, "w"), grad)``, then its bias)."""
    x, y = batch
    hs = [x]
    for layer in params[:-1]:
        hs.append(np.tanh(hs[-1] @ layer["w"] + layer["b"]))
    err = hs[-1] @ params[-1]["w"] + params[-1]["b"] - y
    loss = float(np.mean(err * err))

    def grads() -> Iterator[tuple[Any, NDArray]]:
        d: NDArray = err * np.float32(2.0 / err.size)
        for i in reversed(range(len(params))):
            yield (i, "w"), hs[i].T @ d
            yield (i, "b"), d.sum(axis=0)
            if i:
                d = (d @ params[i]["w"].T) * (1.0 - hs[i] * hs[i])

    return loss, grads()


def as_tree(params: Params, batch: tuple[NDArray, NDArray]) -> tuple[float, Params]:
    """The same gradients, returned as one tree once backward is done."""
    loss, pairs = backward(params, batch)
    tree: Params = [{} for _ in params]
    for (i, name), grad in pairs:
        tree[i][name] = grad
    return loss, tree


def sgd(params: Params, grads: Params) -> Params:
    """SGD in place (every replica's params are its own)."""
    for p, g in zip(params, grads, strict=True):
        for k in p:
            p[k] -= np.float32(LR) * g[k]
    return params


# -- one node process -----------------------------------------------------------------------------
Stamp = tuple[float, float]  # (perf_counter, process_time)


def _stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


def _medians(spans: list[tuple[Stamp, Stamp]]) -> list[float]:
    """``[wall, cpu]`` medians (ms) of ``(start, end)`` stamp pairs."""
    return [round(statistics.median(b[k] - a[k] for a, b in spans) * 1e3, 3) for k in (0, 1)]


def _timed_fit(dp: Any, args: argparse.Namespace, data: tuple[NDArray, NDArray],
               grad_fn: Callable[..., Any]) -> list[float]:
    """``[wall, cpu]`` median step times (ms) of one ``fit`` on this node's first peer, after
    the warm-up (the CPU time is the whole node process's: every thread)."""
    stamps: list[Stamp] = []

    def stamp(comm: Any, _step: int, _params: Any) -> None:
        if comm.peer_id == dp.peer_ids[0]:
            stamps.append(_stamp())

    steps = args.warmup + args.steps + 1
    dp.fit(init(args.layers, args.width), data, grad_fn, sgd, steps=steps, progress=False,
           bucket_bytes=int(args.bucket_mb * 2**20), callback=stamp)
    return _medians(list(itertools.pairwise(stamps))[args.warmup:])


def _parts(dp: Any, args: argparse.Namespace, data: tuple[NDArray, NDArray]
           ) -> list[list[float]]:
    """``[wall, cpu]`` median times (ms) of the compute alone (forward, backward, update) and
    of the gradients' ``all_reduce_tree`` alone, on this node's first peer."""
    from burncoll.train import all_reduce_tree

    def work(comm: Any) -> list[list[float]]:
        per = len(data[0]) // comm.world_size
        shard = tuple(a[comm.rank * per:(comm.rank + 1) * per] for a in data)
        params, grads = init(args.layers, args.width), list[dict[str, NDArray]]()
        compute, reduce = [], []
        for _ in range(args.warmup + args.steps):
            start = _stamp()
            _, grads = as_tree(params, shard)  # type: ignore[arg-type]
            params = sgd(params, grads)
            compute.append((start, _stamp()))
        for _ in range(args.warmup + args.steps):
            comm.barrier()
            start = _stamp()
            all_reduce_tree(comm, grads, "mean", int(args.bucket_mb * 2**20))
            reduce.append((start, _stamp()))
        return [_medians(compute[args.warmup:]), _medians(reduce[args.warmup:])]

    return dp.run(work)[0]  # type: ignore[no-any-return]


def node_main(args: argparse.Namespace) -> int:
    import burncoll
    from burncoll.train import ddp

    config = burncoll.CollectiveConfig(timeout=args.timeout)
    dp = ddp(range(config.num_devices), config)
    world = config.num_devices * (config.num_nodes or 1)
    rng = np.random.default_rng(1)
    n = args.batch * world
    data = (rng.normal(size=(n, args.width)).astype(np.float32),
            rng.normal(size=(n, args.width)).astype(np.float32))
    runs: list[dict[str, list[float]]] = []
    for run in range(args.runs):
        times: dict[str, list[float]] = {}
        for mode in MODES if run % 2 == 0 else MODES[::-1]:
            times[mode] = _timed_fit(dp, args, data, backward if mode == "overlap" else as_tree)
        times["compute"], times["reduce"] = _parts(dp, args, data)
        runs.append(times)
        if dp.node_rank == 0:
            print(f"run {run + 1}/{args.runs}: {times}", file=sys.stderr, flush=True)
    if dp.node_rank == 0:
        Path(args.node).write_text(json.dumps({"runs": runs, "world": world}))
    return 0


# -- the launcher and the table -------------------------------------------------------------------
def _row(name: str, runs: list[dict[str, list[float]]], key: str) -> str:
    wall = [r[key][0] for r in runs]
    cpu = statistics.median(r[key][1] for r in runs)
    return (f"| {name} | {statistics.median(wall):.1f} | {min(wall):.1f}-{max(wall):.1f} | "
            f"{cpu:.1f} |")


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    """The Markdown table of a run of the benchmark."""
    runs = result["runs"]
    grad_mib = args.layers * (args.width + 1) * args.width * 4 / 2**20
    ratios = [r["blocking"][0] / r["overlap"][0] for r in runs]
    lines = [
        f"{args.nodes} nodes x {args.devices} device(s), {args.transport}; MLP {args.layers} x "
        f"{args.width}x{args.width} float32 ({grad_mib:.1f} MiB of gradients), batch "
        f"{args.batch} per peer, bucket {args.bucket_mb:g} MiB, BLAS threads "
        f"{args.blas_threads}; medians of {args.steps} steps, {len(runs)} runs",
        "",
        "| step | median (ms) | range over runs (ms) | node process CPU (ms) |",
        "|---|---|---|---|",
        _row("compute only (forward, backward, update)", runs, "compute"),
        _row("all_reduce_tree only", runs, "reduce"),
        _row("training step, blocking", runs, "blocking"),
        _row("training step, overlap", runs, "overlap"),
        "",
        f"blocking / overlap: {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})",
    ]
    return "\n".join(lines)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help="peer threads per node")
    parser.add_argument("--transport", choices=("websocket", "tcp", "quic"), default="websocket")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="examples per peer")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="bucket_bytes in MiB")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--rate", default=None,
                        help="run the nodes on simulated hosts whose egress is capped at this "
                        "tc rate (e.g. 1gbit; needs root)")
    parser.add_argument("--json", default=None, help="write the runs and the table here")
    parser.add_argument("--node", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _on_hosts(argv: list[str], args: argparse.Namespace, env: dict[str, str]) -> int:
    """Run one node process per simulated host (see ``--rate``); the worst exit code."""
    import secrets

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.multihost.netns import hosts, rate_limit

    with hosts(args.nodes) as made:
        for host in made:
            rate_limit(host, args.rate)
        common = {**os.environ, **env, "BURNCOLL_AUTH_TOKEN": secrets.token_hex(16),
                  "BURNCOLL_NUM_NODES": str(args.nodes),
                  "BURNCOLL_NUM_DEVICES": str(args.devices),
                  "BURNCOLL_TRANSPORT": args.transport,
                  "BURNCOLL_GLOBAL_ADDRESS": f"{made[0].address}:29612",
                  "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        procs = [host.popen(argv, env={**common, "BURNCOLL_NODE_RANK": str(host.index),
                                       "BURNCOLL_NODE_ADDRESS": host.address,
                                       "BURNCOLL_HOST_ORCHESTRATOR": str(int(host.index == 0))})
                 for host in made]
        codes = [proc.wait(timeout=3600) for proc in procs]
        return max(codes, key=abs)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.node is not None:
        return node_main(args)
    from burncoll.orchestration.launch import launch_nodes

    threads = str(args.blas_threads)
    env = {name: threads for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MKL_NUM_THREADS")}
    with tempfile.TemporaryDirectory(prefix="burncoll-overlap-") as tmp:
        out = os.path.join(tmp, "result.json")
        own = sys.argv[1:] if argv is None else argv
        argv_node = [sys.executable, os.path.abspath(__file__), *own, "--node", out]
        code = (_on_hosts(argv_node, args, env) if args.rate else
                launch_nodes(argv_node, args.nodes, args.devices, args.transport, extra_env=env))
        if code != 0:
            print(f"overlap benchmark: a node process failed (exit code {code})",
                  file=sys.stderr)
            return code
        result = json.loads(Path(out).read_text())
    table = report(args, result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "table": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
