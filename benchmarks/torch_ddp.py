"""burncoll's torch.distributed backend against Gloo, and against burncoll's own API.

``ddp``: DistributedDataParallel steps per second of a ~25 M-parameter MLP (six 2048 x 2048
layers, 25 MiB buckets, batch 32 per rank), 2 and 4 processes on this host, on "burncoll" and
on "gloo", in alternating runs; the ratio is burncoll's steps/s over Gloo's of the same round.

``paired``: the same two DDP models in the same processes, one on a "burncoll" process group
and one on a "gloo" group of the same ranks, their steps alternating (burncoll, gloo, gloo,
burncoll, ...), each step timed from a barrier to a barrier: a load that changes during a run
(other jobs on a shared machine) weighs on both alike, where ``ddp``'s separate runs of each
backend can each meet a different load. The ratio is burncoll's steps/s over Gloo's in a run.

``allreduce``: the median time of ``torch.distributed.all_reduce(t)`` through the backend and
of ``comm.all_reduce(a, out=a)`` (the group's own burncoll communicator, ``a`` the NumPy view
of ``t``) on the same tensor, alternating, at 1, 16 and 64 MiB, 2 processes; the ratio is the
first over the second (1.0: the adapter costs nothing).

    python benchmarks/torch_ddp.py [--what ddp,paired,allreduce] [--procs 2,4] [--runs 3]
                                   [--steps 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import burncoll.torch  # noqa: F401  (registers "burncoll")

SIZES_MIB = (1, 16, 64)


def ddp_model(group: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers),
                                                      bucket_cap_mb=25, process_group=group)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def paired_steps(steps: int) -> dict[str, float]:
    """Steps/s of DDP on burncoll (the default group) and on Gloo, steps alternating."""
    groups = {"burncoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    runs = {name: ddp_model(group) for name, group in groups.items()}
    x = torch.randn(32, 2048)
    spent = dict.fromkeys(runs, 0.0)
    for step in range(steps + 2):  # two warm-up steps
        for name in list(runs)[::1 if step % 2 else -1]:
            model, opt = runs[name]
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            dist.barrier(group=groups["gloo"])
            spent[name] += (time.perf_counter() - start) if step >= 2 else 0.0
    return {name: steps / seconds for name, seconds in spent.items()}


def ddp_steps(steps: int) -> float:
    model, opt = ddp_model()
    x = torch.randn(32, 2048)
    for step in range(steps + 2):  # two warm-up steps
        if step == 2:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    dist.barrier()
    return steps / (time.perf_counter() - start)


def allreduce_times(iters: int) -> dict[str, Any]:
    comm = dist.group.WORLD.communicator()  # type: ignore[union-attr]
    result = {}
    for mib in SIZES_MIB:
        t = torch.ones(mib * 2**20 // 4)
        a = t.numpy()
        times: dict[str, list[float]] = {"torch": [], "burncoll": []}
        for i in range(iters + 2):
            for name in ("torch", "burncoll"):
                start = time.perf_counter()
                if name == "torch":
                    dist.all_reduce(t)
                else:
                    comm.all_reduce(a, out=a)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        result[f"{mib} MiB"] = {k: statistics.median(v) for k, v in times.items()}
    return result


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.size,
                            timeout=datetime.timedelta(seconds=120))
    value = {"ddp": lambda: ddp_steps(args.steps), "paired": lambda: paired_steps(args.steps),
             "allreduce": lambda: allreduce_times(args.iters)}[args.worker]()
    if args.rank == 0:
        print(json.dumps(value), flush=True)
    dist.destroy_process_group()


def launch(what: str, backend: str, size: int, args: argparse.Namespace) -> Any:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", what, "--backend", backend, "--rank", str(r),
         "--size", str(size), "--port", str(port), "--steps", str(args.steps),
         "--iters", str(args.iters)], stdout=subprocess.PIPE, text=True)
        for r in range(size)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{what} {backend} x{size} failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", default="ddp,allreduce")
    parser.add_argument("--procs", default="2,4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="burncoll", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    what = args.what.split(",")
    if "ddp" in what:
        for size in (int(p) for p in args.procs.split(",")):
            rates: dict[str, list[float]] = {"burncoll": [], "gloo": []}
            for _ in range(args.runs):
                for backend in rates:
                    rates[backend].append(launch("ddp", backend, size, args))
            ratios = [b / g for b, g in zip(rates["burncoll"], rates["gloo"], strict=True)]
            print(f"ddp x{size}: burncoll {statistics.median(rates['burncoll']):.2f} steps/s, "
                  f"gloo {statistics.median(rates['gloo']):.2f} steps/s, ratio (median of "
                  f"runs) {statistics.median(ratios):.2f}  runs: burncoll "
                  f"{[round(r, 2) for r in rates['burncoll']]} gloo "
                  f"{[round(r, 2) for r in rates['gloo']]}", flush=True)
    if "paired" in what:
        for size in (int(p) for p in args.procs.split(",")):
            pairs = [launch("paired", "burncoll", size, args) for _ in range(args.runs)]
            ratios = [p["burncoll"] / p["gloo"] for p in pairs]
            print(f"ddp paired x{size}: burncoll "
                  f"{statistics.median(p['burncoll'] for p in pairs):.2f} steps/s, gloo "
                  f"{statistics.median(p['gloo'] for p in pairs):.2f} steps/s, ratio (median of "
                  f"runs) {statistics.median(ratios):.2f}  runs: "
                  f"{[round(r, 2) for r in ratios]}", flush=True)
    if "allreduce" in what:
        runs = [launch("allreduce", "burncoll", 2, args) for _ in range(args.runs)]
        for mib in SIZES_MIB:
            key = f"{mib} MiB"
            ratios = [r[key]["torch"] / r[key]["burncoll"] for r in runs]
            print(f"all_reduce {key} x2: torch backend "
                  f"{statistics.median(r[key]['torch'] for r in runs) * 1e3:.2f} ms, "
                  f"burncoll API {statistics.median(r[key]['burncoll'] for r in runs) * 1e3:.2f}"
                  f" ms, ratio (median of runs) {statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
