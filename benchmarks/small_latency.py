"""Latency of one small all-reduce between node processes (2 by default), per call, in µs.

``burncoll bench`` reports the median of the slowest peer with a barrier before each call;
this one times back-to-back calls on node 0 (as a training loop issues them), which shows the
spread (10th percentile, median) that a barrier hides, and node 0's CPU time per call (its
process's, ``cpu``, and its calling thread's, ``thread_cpu``). ``--load N`` runs N CPU-bound
processes beside it, as ``burncoll bench --load`` does.

``--profile`` runs node 0's operations under ``cProfile`` instead and lists where its calling
thread's time goes, per operation: each module's own time, and the ``--top N`` functions by
own time (cProfile adds a cost to every call, so read the shares, not the sum).

``--count-calls`` counts instead the Python and C function calls of one operation on node 0
(``sys.setprofile``), and ``--top N`` lists the N functions called most. Times on a shared
machine move by half from one minute to the next; the number of calls does not, and on this
path it is most of the time: a count that goes down is a path that got shorter.

    python benchmarks/small_latency.py [--nodes 2] [--bytes 8] [--iters 2000] [--runs 3] [--load 2]
    python benchmarks/small_latency.py --count-calls [--top 20]
    python benchmarks/small_latency.py --profile [--nodes 4] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import sys
import time
from types import FrameType
from typing import Any

import numpy as np

import burncoll
from burncoll.bench.load import cpu_load
from burncoll.bench.node_scripts import node_script_parser, node_zero_line


def node(index: int, args: argparse.Namespace) -> None:
    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=args.nodes,
                                       global_address=args.address, node_address="127.0.0.1",
                                       transport=args.transport, timeout=30)
    comm = burncoll.register(index, 0, config)
    x = np.ones(max(args.bytes // 4, 1), np.float32)
    for _ in range(200):
        comm.all_reduce(x)
    if args.count_calls:
        result = count_calls(comm, x, args.iters, args.top, index == 0)
    elif args.profile:
        result = profile(comm, x, args.iters, args.top, index == 0)
    else:
        times = []
        cpu, thread = time.process_time(), time.thread_time()
        for _ in range(args.iters):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - start)
        cpu, thread = time.process_time() - cpu, time.thread_time() - thread
        times.sort()
        result = {"p10": times[len(times) // 10] * 1e6, "median": times[len(times) // 2] * 1e6,
                  "cpu": cpu / args.iters * 1e6, "thread_cpu": thread / args.iters * 1e6}
    comm.finish()
    if index == 0:
        print(json.dumps(result))


def count_calls(comm: burncoll.Communicator, x: np.ndarray, ops: int, top: int, counting: bool
                ) -> dict[str, Any]:
    """Python and C calls per all-reduce of ``x`` (counted where ``counting``), checked."""
    calls: collections.Counter[str] = collections.Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            calls["python"] += 1
            calls[f"{code.co_qualname} ({code.co_filename.rsplit('/', 1)[-1]})"] += 1
        elif event == "c_call":
            calls["C"] += 1

    if counting:
        sys.setprofile(count)
    for _ in range(ops):
        result = comm.all_reduce(x)
    sys.setprofile(None)
    if not np.array_equal(result, np.full_like(x, comm.world_size)):
        raise SystemExit(f"wrong result: {result}")
    return {"python": calls.pop("python", 0) / ops, "C": calls.pop("C", 0) / ops,
            "top": [(name, n / ops) for name, n in calls.most_common(top)]}


def profile(comm: burncoll.Communicator, x: np.ndarray, ops: int, top: int, profiling: bool
            ) -> dict[str, Any]:
    """Own time (µs per all-reduce of ``x``) by module and the ``top`` functions, profiled
    with cProfile where ``profiling``; the result checked."""
    profiler = cProfile.Profile()
    if profiling:
        profiler.enable()
    for _ in range(ops):
        result = comm.all_reduce(x)
    profiler.disable()
    if not np.array_equal(result, np.full_like(x, comm.world_size)):
        raise SystemExit(f"wrong result: {result}")
    if not profiling:
        return {}
    modules: collections.Counter[str] = collections.Counter()
    functions = []
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (file, _, name), (_, calls, own, total, _) in stats.items():
        module = file.split("burncoll/", 1)[-1] if "burncoll/" in file else file.rsplit("/", 1)[-1]
        modules[module] += own / ops * 1e6
        functions.append((own / ops * 1e6, total / ops * 1e6, calls / ops, f"{name} ({module})"))
    functions.sort(reverse=True)
    return {"modules": modules.most_common(), "top": functions[:top]}


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    line = node_zero_line(__file__, args.nodes, args.transport, [
        "--bytes", str(args.bytes), "--iters", str(args.iters), "--nodes", str(args.nodes),
        "--top", str(args.top)] + (["--count-calls"] if args.count_calls else [])
        + (["--profile"] if args.profile else []))
    result: dict[str, Any] = json.loads(line)
    return result


def main() -> None:
    parser = node_script_parser(__doc__ or "", iters=2000)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--count-calls", action="store_true",
                        help="count the calls of one operation on node 0 instead of timing")
    parser.add_argument("--top", type=int, default=0, help="with --count-calls: list the N "
                        "functions called most")
    parser.add_argument("--profile", action="store_true",
                        help="profile node 0's operations (cProfile) instead of timing")
    args = parser.parse_args()
    if args.node is not None:
        node(args.node, args)
        return
    if args.count_calls:
        counted = one_run(args)
        print(f"per {args.bytes} B all-reduce, {args.nodes} nodes: {counted['python']:.0f} "
              f"Python calls, {counted['C']:.0f} C calls")
        for name, n in counted["top"]:
            print(f"  {n:5.1f}  {name}")
        return
    if args.profile:
        profiled = one_run(args)
        print(f"per {args.bytes} B all-reduce, {args.nodes} nodes, node 0's own time (µs, "
              f"under cProfile) by module:")
        for module, us in profiled["modules"]:
            print(f"  {us:7.2f}  {module}")
        print("functions: own µs, cumulative µs, calls")
        for own, total, calls, name in profiled["top"]:
            print(f"  {own:7.2f} {total:8.2f} {calls:5.1f}  {name}")
        return
    with cpu_load(args.load):
        runs = [one_run(args) for _ in range(args.runs)]
    for key in ("p10", "median", "cpu", "thread_cpu"):
        values = [r[key] for r in runs]
        print(f"{key:>6}: median of {len(values)} runs {statistics.median(values):7.1f} us "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
