"""A jitted step with the all-reduce inside: burncoll.jax against mpi4jax, between node processes.

The step is ``x = jax.jit(lambda x: all_reduce(x) / world_size)(x)`` on float32 arrays, one
device per node process (2 by default); node 0 times back-to-back steps (each waited for
with ``block_until_ready``) and reports the median per size. burncoll's nodes meet at an
orchestrator (``--transport``, tcp by default); mpi4jax's run under ``mpirun`` (Open MPI:
``--allow-run-as-root --oversubscribe``). The two alternate, ``--runs`` times; the table
gives the median of the runs' medians and the ratio burncoll / mpi4jax, and beside them
burncoll's eager ``Communicator.all_reduce`` of NumPy arrays (the same step outside jit).

    python benchmarks/jax_jit.py [--nodes 2] [--runs 3] [--sizes 8,1K,64K,1M,16M,64M] [--iters N]

(``--iters 0``, the default: as many steps per size as reduce about 64 MiB, 20 to 1000.)

mpi4jax is not a dependency of burncoll (``apt-get install openmpi-bin libopenmpi-dev``, then
``pip install mpi4py mpi4jax``); without it, or without ``mpirun``, only burncoll is timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from burncoll.bench.node_scripts import node_script_parser, node_zero_line

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPI4JAX_NO_WARN_JAX_VERSION", "1")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def steps_for(nbytes: int, iters: int) -> int:
    """Steps timed per size: ``iters``, or (0) about 64 MiB reduced, 20 to 1000 steps."""
    return iters or max(20, min(1000, (64 << 20) // max(nbytes, 1)))


def time_steps(step: Callable[[Any], Any], full: Callable[..., Any], sizes: list[int],
               iters: int) -> dict[str, float]:
    """Median µs per ``x = step(x)`` (waited for), by size in bytes, with ``x`` made by
    ``full(elements, 3.0, float32)``; checks the values stay right."""
    import jax
    import numpy as np

    medians = {}
    for nbytes in sizes:
        x = full(max(nbytes // 4, 1), 3.0, np.float32)
        for _ in range(5):  # compile, warm up
            x = jax.block_until_ready(step(x))
        times = []
        for _ in range(steps_for(nbytes, iters)):
            start = time.perf_counter()
            x = jax.block_until_ready(step(x))
            times.append(time.perf_counter() - start)
        if not np.all(np.asarray(x) == 3.0):
            raise SystemExit(f"wrong result at {nbytes} B")
        medians[str(nbytes)] = statistics.median(times) * 1e6
    return medians


def burncoll_node(args: argparse.Namespace, sizes: list[int]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import burncoll
    import burncoll.jax as bj

    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=args.nodes,
                                       global_address=args.address, node_address="127.0.0.1",
                                       transport=args.transport, timeout=60)
    comm = burncoll.register(args.node, 0, config)
    world = comm.world_size
    jitted = time_steps(jax.jit(lambda x: bj.all_reduce(x, comm) / world), jnp.full, sizes,
                        args.iters)
    eager = time_steps(lambda x: comm.all_reduce(x) / world, np.full, sizes, args.iters)
    comm.finish()
    if args.node == 0:
        print(json.dumps({"jit": jitted, "eager": eager}), flush=True)


def mpi4jax_node(sizes: list[int], iters: int) -> None:
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    medians = time_steps(jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) / world),
                         jnp.full, sizes, iters)
    if comm.Get_rank() == 0:
        print(json.dumps(medians), flush=True)


def mpi4jax_run(args: argparse.Namespace) -> dict[str, float] | None:
    """One run under mpirun; None when mpi4jax or mpirun is missing."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("mpi4jax") is None:
        return None
    done = subprocess.run(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(args.nodes),
         sys.executable, __file__, "--mpi4jax-node", "--sizes", args.sizes,
         "--iters", str(args.iters)],
        capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        raise SystemExit(f"mpirun failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = node_script_parser(__doc__ or "", iters=0)
    parser.add_argument("--sizes", default="8,1K,64K,1M,16M,64M", help="bytes, comma-separated")
    parser.add_argument("--mpi4jax-node", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.mpi4jax_node:
        mpi4jax_node(sizes, args.iters)
        return
    if args.node is not None:
        burncoll_node(args, sizes)
        return
    ours: list[dict[str, dict[str, float]]] = []
    theirs: list[dict[str, float]] = []
    for _ in range(args.runs):
        line = node_zero_line(__file__, args.nodes, args.transport,
                              ["--nodes", str(args.nodes), "--sizes", args.sizes,
                               "--iters", str(args.iters)])
        ours.append(json.loads(line))
        other = mpi4jax_run(args)
        if other is not None:
            theirs.append(other)
    print(f"jitted all-reduce step, {args.nodes} node processes, median of {args.runs} runs "
          "(us per step)")
    print("(burncoll eager: Communicator.all_reduce on NumPy arrays, outside jit; "
          "ratio: burncoll jit / mpi4jax)")
    print(f"{'bytes':>10} {'burncoll':>10} {'(eager)':>10} {'mpi4jax':>10} {'ratio':>7}")
    for nbytes in sizes:
        mine, eager = (statistics.median(r[kind][str(nbytes)] for r in ours)
                       for kind in ("jit", "eager"))
        if theirs:
            other = statistics.median(r[str(nbytes)] for r in theirs)
            print(f"{nbytes:>10} {mine:>10.1f} {eager:>10.1f} {other:>10.1f} "
                  f"{mine / other:>7.2f}")
        else:
            print(f"{nbytes:>10} {mine:>10.1f} {eager:>10.1f} {'-':>10} {'-':>7}")
    print("runs (burncoll jit / mpi4jax, us):", "; ".join(
        f"{n}: " + ", ".join(f"{r['jit'][str(n)]:.0f}" for r in ours) + " / "
        + ", ".join(f"{r[str(n)]:.0f}" for r in theirs) for n in sizes))


if __name__ == "__main__":
    main()
