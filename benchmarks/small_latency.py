"""Latency of one small all-reduce between node processes (2 by default), per call, in µs.

``burncoll bench`` reports the median of the slowest peer with a barrier before each call;
this one times back-to-back calls on node 0 (as a training loop issues them), which shows the
spread (10th percentile, median) that a barrier hides. ``--load N`` runs N CPU-bound
processes beside it, as ``burncoll bench --load`` does.

    python benchmarks/small_latency.py [--nodes 2] [--bytes 8] [--iters 2000] [--runs 3] [--load 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

import burncoll
from burncoll.bench.load import cpu_load


def node(index: int, nodes: int, address: str, transport: str, nbytes: int, iters: int) -> None:
    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=nodes, global_address=address,
                                       node_address="127.0.0.1", transport=transport,
                                       timeout=30)
    comm = burncoll.register(index, 0, config)
    x = np.ones(max(nbytes // 4, 1), np.float32)
    for _ in range(200):
        comm.all_reduce(x)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        comm.all_reduce(x)
        times.append(time.perf_counter() - start)
    comm.finish()
    if index == 0:
        times.sort()
        print(json.dumps({"p10": times[len(times) // 10] * 1e6,
                          "median": times[len(times) // 2] * 1e6}))


def one_run(args: argparse.Namespace) -> dict[str, float]:
    with burncoll.start_orchestrator(transport=args.transport) as orch:
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--node", str(i), "--address", orch.address,
             "--transport", args.transport, "--bytes", str(args.bytes),
             "--iters", str(args.iters), "--nodes", str(args.nodes)],
            stdout=subprocess.PIPE, text=True)
            for i in range(args.nodes)]
        out = [p.communicate(timeout=600)[0] for p in procs]
    result: dict[str, float] = json.loads(out[0].strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        node(args.node, args.nodes, args.address, args.transport, args.bytes, args.iters)
        return
    with cpu_load(args.load):
        runs = [one_run(args) for _ in range(args.runs)]
    for key in ("p10", "median"):
        values = [r[key] for r in runs]
        print(f"{key:>6}: median of {len(values)} runs {statistics.median(values):7.1f} us "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
