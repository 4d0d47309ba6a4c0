"""The N-sweep: N node processes of one device each on this host, burncoll beside Gloo.

For each N (4, 8, 16, 32, 64 by default) the script runs N burncoll node processes (the
transport given, websocket by default; a token set) and then N ``torch.distributed`` Gloo
processes, and prints one row per library: the registration time, twice -- the slowest
process's, from its call to ``burncoll.register`` / ``init_process_group`` to its return
(which includes waiting for the processes still starting), and from the last process's call
to the last return (the session's own work, once every process is there) --, the median over
processes of the 8 B and 1 MiB all-reduce (per process: the median of ``--iters`` calls,
each after a barrier), and, medians over processes after those operations, the open descriptors
(``/proc/self/fd``) and the resident and proportional sizes (``/proc/self/smaps_rollup``).
Every burncoll result is checked against a NumPy float64 reference.

    python benchmarks/scale.py [--sizes 4,8,16,32,64] [--iters 20] [--no-gloo]
                               [--transport websocket|tcp|quic] [--json FILE]
    python benchmarks/scale.py --tables --sizes 64,256,1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

TOKEN = "scale-benchmark-token-0123456789"
SIZES = (8, 1 << 20)


def memory() -> dict[str, float]:
    """This process's open descriptors, and its RSS and PSS in MiB."""
    out = {"fds": float(len(os.listdir("/proc/self/fd")))}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(value.split()[0]) / 1024
    return out


def timed(call: Callable[[], Any], barrier: Callable[[], Any], iters: int) -> float:
    """The median time of ``call`` in ms, each after ``barrier``, after 3 untimed calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def burncoll_node(index: int, args: argparse.Namespace) -> dict[str, Any]:
    import burncoll

    # (what register imports on first use, imported before the clock as Gloo's torch is)
    import burncoll.node.joining
    import burncoll.transport.websocket

    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=args.nodes,
                                       global_address=args.address, node_address="127.0.0.1",
                                       auth_token=TOKEN, timeout=args.timeout,
                                       transport=args.transport)
    start, called = time.perf_counter(), time.time()
    comm = burncoll.register(index, 0, config)
    result: dict[str, Any] = {"register": time.perf_counter() - start, "called": called,
                              "returned": time.time()}
    for size in SIZES:
        x = np.arange(max(size // 4, 1), dtype=np.float32) + index
        out = np.empty_like(x)
        comm.all_reduce(x, out=out)
        reference = sum(np.arange(x.size, dtype=np.float64) + i for i in range(args.nodes))
        if not np.allclose(out, reference, rtol=1e-5):
            raise SystemExit(f"node {index}: wrong {size} B all-reduce result")
        result[str(size)] = timed(lambda x=x, out=out: comm.all_reduce(x, out=out), comm.barrier,
                                  args.iters)
    result.update(memory())
    comm.finish()
    return result


def gloo_node(index: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    start, called = time.perf_counter(), time.time()
    dist.init_process_group("gloo", init_method=f"tcp://{args.address}", rank=index,
                            world_size=args.nodes)
    result: dict[str, Any] = {"register": time.perf_counter() - start, "called": called,
                              "returned": time.time()}
    for size in SIZES:
        x = torch.ones(max(size // 4, 1), dtype=torch.float32)
        result[str(size)] = timed(lambda x=x: dist.all_reduce(x), dist.barrier, args.iters)
    result.update(memory())
    dist.destroy_process_group()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(library: str, nodes: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every process's result of one library at ``nodes`` processes."""
    from burncoll.orchestration.orchestrator import start_orchestrator

    argv = ["--library", library, "--nodes", str(nodes), "--iters", str(args.iters),
            "--timeout", str(args.timeout), "--transport", args.transport]
    if library == "burncoll":
        with start_orchestrator(transport=args.transport, auth_token=TOKEN) as orch:
            return _spawn([*argv, "--address", orch.address], nodes, args.timeout)
    return _spawn([*argv, "--address", f"127.0.0.1:{free_port()}"], nodes, args.timeout)


def _spawn(argv: list[str], nodes: int, timeout: float) -> list[dict[str, Any]]:
    procs = [subprocess.Popen([sys.executable, __file__, "--node", str(i), *argv],
                              stdout=subprocess.PIPE, text=True) for i in range(nodes)]
    outs = [p.communicate(timeout=timeout + 300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{argv[1]} at {nodes} processes: a process failed")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def row(library: str, nodes: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in results)

    return {"library": library, "nodes": nodes,
            "register_s": max(r["register"] for r in results),
            "register_all_there_s": max(r["returned"] for r in results)
            - max(r["called"] for r in results),
            "allreduce_8B_ms": median("8"), "allreduce_1MiB_ms": median(str(1 << 20)),
            "fds": median("fds"), "max_fds": max(r["fds"] for r in results),
            "rss_mib": median("rss"), "pss_mib": median("pss")}


def tables(sizes: list[int]) -> None:
    """The orchestrator's work for the node tables of a session of each size (no processes:
    its members as it holds them, one host), the fastest of 3, and the bytes it sends."""
    from burncoll.orchestration.waiting import Member, Session

    print("| N | encoding every member's table (ms) | bytes sent (MB) |\n|---|---|---|")
    for n in sizes:
        members = [Member(None, "127.0.0.1", 40000 + i, (i,), {"num_nodes": n},  # type: ignore[arg-type]
                          {"sharded": False, "host": "f" * 32, "lanes": True}) for i in range(n)]
        session, best, frames = Session.form(members), float("inf"), []
        for _ in range(3):
            start = time.perf_counter()
            frames = session.tables()
            best = min(best, time.perf_counter() - start)
        print(f"| {n} | {best * 1e3:.1f} | {sum(map(len, frames)) / 1e6:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="4,8,16,32,64")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--transport", default="websocket", help="burncoll's transport")
    parser.add_argument("--json", default=None)
    parser.add_argument("--library", default="burncoll", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tables", action="store_true", help="only the orchestrator's work "
                        "for the node tables at each of --sizes (no processes)")
    args = parser.parse_args()
    if args.tables:
        tables([int(n) for n in args.sizes.split(",")])
        return
    if args.node is not None:
        node = burncoll_node if args.library == "burncoll" else gloo_node
        print(json.dumps(node(args.node, args)))
        return
    rows = []
    print("| N | library | registration (s; once all there) | 8 B all-reduce (ms) | "
          "1 MiB all-reduce (ms) | fds per node (median / max) | RSS / PSS per node (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for nodes in (int(n) for n in args.sizes.split(",")):
        for library in ("burncoll",) + (() if args.no_gloo else ("gloo",)):
            r = row(library, nodes, run(library, nodes, args))
            rows.append(r)
            print(f"| {nodes} | {library} | {r['register_s']:.2f} "
                  f"({r['register_all_there_s']:.2f}) | {r['allreduce_8B_ms']:.3f} "
                  f"| {r['allreduce_1MiB_ms']:.2f} | {r['fds']:.0f} / {r['max_fds']:.0f} | "
                  f"{r['rss_mib']:.0f} / {r['pss_mib']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
