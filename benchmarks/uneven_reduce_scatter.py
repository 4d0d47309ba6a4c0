"""Time of a reduce-scatter with explicit ``counts`` (uneven blocks, as FSDP-style sharding
uses) between node processes with several devices each, on node 0's first peer, in ms.

Each node process runs ``--devices`` peer threads; every peer passes the same ``--mib`` MiB of
float32 and counts that give the last rank the remainder. A barrier precedes each call; the
result is checked (every input is ones, so every element is the world size). Run it from a
worktree of each revision to compare (``PYTHONPATH=<worktree>``); the machine is shared, so
alternate the revisions and compare medians.

    python benchmarks/uneven_reduce_scatter.py [--nodes 2] [--devices 4] [--mib 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

import burncoll
from burncoll.bench.node_scripts import node_script_parser, node_zero_line


def node(index: int, args: argparse.Namespace) -> None:
    config = burncoll.CollectiveConfig(
        num_devices=args.devices, num_nodes=args.nodes, global_address=args.address,
        node_address="127.0.0.1", transport=args.transport, timeout=120)
    world = args.nodes * args.devices
    rows = args.mib * 2**20 // 4
    counts = [rows // world] * world
    counts[-1] += rows - sum(counts)
    times: list[float] = []
    wrong: list[str] = []

    def peer(device: int) -> None:
        comm = burncoll.register(index * args.devices + device, device, config)
        x = np.ones(rows, np.float32)
        for i in range(args.iters + 2):
            comm.barrier()
            start = time.perf_counter()
            mine = comm.reduce_scatter(x, "sum", counts=counts)
            if device == 0 and i >= 2:
                times.append(time.perf_counter() - start)
        if mine.shape != (counts[comm.rank],) or not np.all(mine == world):
            wrong.append(f"rank {comm.rank}: {mine[:4]} (want {world})")
        comm.finish()

    threads = [threading.Thread(target=peer, args=(d,)) for d in range(args.devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if wrong:
        raise SystemExit(f"wrong results: {wrong}")
    if index == 0:
        print(json.dumps(statistics.median(times)))


def one_run(args: argparse.Namespace) -> float:
    return float(json.loads(node_zero_line(__file__, args.nodes, args.transport, [
        "--nodes", str(args.nodes), "--devices", str(args.devices), "--mib", str(args.mib),
        "--iters", str(args.iters)])))


def main() -> None:
    parser = node_script_parser(__doc__ or "", iters=8)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--mib", type=int, default=16)
    args = parser.parse_args()
    if args.node is not None:
        node(args.node, args)
        return
    runs = [one_run(args) * 1e3 for _ in range(args.runs)]
    print(f"reduce_scatter(counts=), {args.mib} MiB per peer, {args.nodes} nodes x "
          f"{args.devices} devices: median of {len(runs)} runs {statistics.median(runs):.1f} ms "
          f"(runs: {', '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
