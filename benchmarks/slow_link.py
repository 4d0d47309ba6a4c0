"""All-reduce between simulated hosts on a rate-limited link: Gloo, burncoll, burncoll with
``compression="bf16"`` (and ``"fp16"``).

Each host is a network namespace on one bridge (``tests/multihost/netns.py``) whose egress is
capped with ``tc ... tbf`` (default 1 Gbit/s); ``--per-host`` processes per host (default 1,
ranks numbered host by host as torchrun numbers them) run the all-reduce of float32 arrays.
Every system runs in turn in the same hosts, ``--runs`` times; the table gives the median over
runs of each run's median time per call (the slowest process's), and the bus bandwidth
``2 (n - 1) / n * bytes / time`` over the ``n`` processes, like nccl-tests. Needs root
(``ip netns``) and torch (CPU build) for Gloo. Run from the repository root::

    sudo .venv/bin/python benchmarks/slow_link.py --hosts 2 --sizes 16,64,256 --runs 3

With several processes per host, burncoll composes its schedules by host under ``auto``
(``burncoll.strategies.ByHost``); ``--strategies ring`` adds a row for the flat ring over
every process (``burncoll:ring``), as Gloo runs it.

The burncoll rows also print the largest error of the compressed result against the float64
sum, relative to ``sum(|x_i|)`` (the bound of ``burncoll.compression``: ``(n + 1) * u``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20
PORT = 29611


def _bytes(text: str) -> int:
    """A size in bytes: ``"16"`` is 16 MiB (the old form), ``"128K"`` as ``burncoll bench -b``."""
    from burncoll.bench.options import parse_size

    return int(text) * MIB if text.isdigit() else parse_size(text)


def _label(size: int) -> str:
    return f"{size // MIB}M" if size % MIB == 0 else f"{size // 1024}K"


def _input(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(count).astype(np.float32)


def _burncoll_worker(args: argparse.Namespace) -> dict[str, Any]:
    import burncoll

    cfg = burncoll.CollectiveConfig(
        num_nodes=args.world, node_rank=args.rank, num_devices=1,
        global_address=f"{args.master}:{PORT}", node_address=args.address,
        host_orchestrator=args.rank == 0, timeout=300, transport=args.transport,
        global_all_reduce_strategy=args.strategy or "auto")
    comm = burncoll.register(args.rank, 0, cfg)
    times: dict[str, list[float]] = {}
    errors: dict[str, float] = {}
    for size in args.sizes:
        x = _input(args.rank, size // 4)
        spent = []
        for i in range(args.warmup + args.iters):
            comm.barrier()
            start = time.perf_counter()
            result = comm.all_reduce(x, compression=args.compression)
            if i >= args.warmup:
                spent.append(time.perf_counter() - start)
        times[str(size)] = spent
        if args.rank == 0:
            xs = [_input(r, x.size).astype(np.float64) for r in range(args.world)]
            magnitude = np.maximum(sum(np.abs(v) for v in xs), 1e-30)
            errors[str(size)] = float((np.abs(result - sum(xs)) / magnitude).max())
    comm.finish()
    return {"times": times, "errors": errors}


def _gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=300))
    times: dict[str, list[float]] = {}
    for size in args.sizes:
        source = torch.from_numpy(_input(args.rank, size // 4))
        buffer = source.clone()
        spent = []
        for i in range(args.warmup + args.iters):
            buffer.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if i >= args.warmup:
                spent.append(time.perf_counter() - start)
        times[str(size)] = spent
    dist.destroy_process_group()
    return {"times": times, "errors": {}}


def _worker(args: argparse.Namespace) -> int:
    result = _gloo_worker(args) if args.system == "gloo" else _burncoll_worker(args)
    print("SLOW_LINK_RESULT " + json.dumps(result), flush=True)
    return 0


def _run_system(hosts: list[Any], system: str, args: argparse.Namespace
                ) -> dict[str, Any]:
    """One run of ``system`` on every host; per size the slowest host's median, the error."""
    env = dict(os.environ, BURNCOLL_AUTH_TOKEN=args.token, GLOO_SOCKET_IFNAME="eth0",
               PYTHONPATH=str(REPO))
    procs = []
    for host, local in ((h, k) for h in hosts for k in range(args.per_host)):
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--system", system,
                "--rank", str(host.index * args.per_host + local), "--world",
                str(len(hosts) * args.per_host), "--master",
                hosts[0].address, "--address", host.address, "--sizes",
                ",".join(f"{s}B" for s in args.sizes), "--iters", str(args.iters), "--warmup",
                str(args.warmup), "--transport", args.transport]
        procs.append(host.popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        line = next((ln for ln in out.splitlines() if ln.startswith("SLOW_LINK_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"{system} worker failed ({proc.returncode}):\n{out[-2000:]}")
        results.append(json.loads(line.split(" ", 1)[1]))
    rows = {}
    for size in map(str, args.sizes):
        per_iter = [max(r["times"][size][i] for r in results) for i in range(args.iters)]
        rows[size] = {"seconds": statistics.median(per_iter),
                      "error": results[0]["errors"].get(size)}
    return rows


def _table(all_runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    n = args.hosts * args.per_host
    factor = 2 * (n - 1) / n
    print(f"\n{args.hosts} hosts x {args.per_host} processes, egress {args.rate} each, "
          f"float32, {args.runs} runs (median of run medians)\n")
    systems = list(all_runs)
    print(f"{'size':>5} " + " ".join(f"{s + ' GB/s':>16}" for s in systems)
          + "  " + " ".join(f"{s + '/gloo':>16}" for s in systems if s != "gloo")
          + "  max rel. error")
    for size in map(str, args.sizes):
        bw = {}
        for s in systems:
            seconds = statistics.median(run[size]["seconds"] for run in all_runs[s])
            bw[s] = factor * int(size) / seconds / 1e9
        errors = {s: all_runs[s][0][size]["error"] for s in systems if s != "gloo"}
        print(f"{_label(int(size)):>5} " + " ".join(f"{bw[s]:>16.4f}" for s in systems) + "  "
              + " ".join(f"{bw[s] / bw['gloo']:>16.2f}" for s in systems if s != "gloo")
              + "  " + ", ".join(f"{s}: {e:.1e}" for s, e in errors.items() if e is not None))


def _drive(args: argparse.Namespace) -> int:
    from tests.multihost.netns import hosts, rate_limit

    systems = ["gloo", "burncoll", *[f"burncoll:{s}" for s in args.strategies],
               *[f"burncoll-{c}" for c in args.compressions]]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with hosts(args.hosts) as made:
        for host in made:
            rate_limit(host, args.rate)
        for run in range(args.runs):
            for system in systems:
                runs[system].append(_run_system(made, system, args))
                print(f"run {run + 1}/{args.runs}: {system} done", file=sys.stderr)
    _table(runs, args)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=1, help="processes on each host")
    parser.add_argument("--strategies", default="",
                        help="more burncoll rows with this global strategy, comma-separated")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's egress")
    parser.add_argument("--sizes", default="16,64,256",
                        help="comma-separated; a plain number is MiB, else 128K, 1M, ...")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--transport", default="websocket")
    parser.add_argument("--compressions", default="bf16",
                        help="compressed burncoll rows, comma-separated (bf16, fp16)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="burncoll", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [_bytes(s) for s in str(args.sizes).split(",") if s]
    if args.worker:
        named, _, args.strategy = args.system.partition(":")
        system, _, compression = named.partition("-")
        args.system = system
        args.compression = compression or "none"
        return _worker(args)
    args.compressions = [c for c in str(args.compressions).split(",") if c]
    args.strategies = [s for s in str(args.strategies).split(",") if s]
    args.token = secrets.token_hex(16)
    return _drive(args)


if __name__ == "__main__":
    sys.exit(main())
