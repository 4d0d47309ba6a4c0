"""Calibrate the cost model (:mod:`burncoll.strategies.cost`) on this machine and compare it
with measured all-reduce times.

For every number of node processes (``--nodes``, one device each) and global strategy
(``--strategies``: schedules, and ``auto``, whose small all-reduces are the one-round
exchange), ``burncoll bench`` measures the all-reduce at ``--sizes`` (the median over nodes of
the slowest peer, a barrier before each). The schedules' constants (``alpha`` per round,
``overhead`` per message, ``beta`` per byte, ``gamma`` per byte reduced) are fitted, by least
squares on relative errors, to the runs of 2 nodes only; the exchange's (another medium: the
host mail) to its runs of 2 and 4 nodes. Every other row is a prediction: the table prints it
beside the measurement, one core per node (``path``) and with the nodes sharing this host's
cores (``host``). Last, what the model picks per number of nodes and size, one node per host.

    python benchmarks/cost_model.py [--nodes 2,4,8] [--sizes 8,512,32K,2M] [--iters 15]
        [--strategies centralized,tree,ring,doubling,auto] [--transport websocket]
        [--samples run1.json]    # keeps the run's samples
    python benchmarks/cost_model.py --samples run1.json --samples run2.json  # their medians

Do not run more than 8 node processes on a machine others share (docs/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from burncoll.bench.options import parse_size
from burncoll.strategies import Doubling, Ring, Strategy, Tree, parse_strategy
from burncoll.strategies.auto import exchange_limit
from burncoll.strategies.cost import EXCHANGE, Cost, Params, cost

#: (nodes, route, size in bytes, measured seconds)
Sample = tuple[int, str, int, float]
CANDIDATES: list[Strategy | str] = [EXCHANGE, Doubling(), Tree(2), Ring()]


def measure(nodes: int, strategy: str, sizes: Sequence[int], iters: int,
            transport: str) -> dict[int, float]:
    """``burncoll bench``'s all-reduce times (seconds) by size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(
            [sys.executable, "-m", "burncoll", "bench", "--nodes", str(nodes), "-g", "1",
             "--global-strategy", strategy, "-b", str(min(sizes)), "-e", str(max(sizes)),
             "-f", str(sizes[1] // sizes[0] if len(sizes) > 1 else 2), "-n", str(iters),
             "-w", "3", "--transport", transport, "--json", str(out)],
            check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["rows"]
    return {r["size"]: r["time_us"] * 1e-6 for r in rows if r["size"] in sizes}


def route_cost(route: str, nodes: int, size: int) -> Cost:
    return cost(route if route == EXCHANGE else parse_strategy(route), "all_reduce", nodes, size)


def features(c: Cost) -> list[float]:
    """The coefficients of (alpha, overhead, beta, gamma) in the path time of ``c``."""
    return [len(c.rounds), sum(r.messages for r in c.rounds),
            float(sum(r.bytes for r in c.rounds)), float(sum(r.reduced for r in c.rounds))]


def reduction_seconds_per_byte(nbytes: int = 4 << 20, repeat: int = 20) -> float:
    """``gamma``: this machine's float32 sum of two arrays, per byte (the best of ``repeat``)."""
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def fit(samples: Sequence[Sample], gamma: float, beta: float | None = None) -> Params:
    """``alpha``, ``overhead`` and (unless given) ``beta`` by least squares on relative errors
    (a constant that comes out negative is dropped), ``gamma`` as measured."""
    rows = np.array([features(route_cost(r, n, s)) for n, r, s, _ in samples])
    seconds = np.array([t for *_, t in samples]) - gamma * rows[:, 3]
    known = {3: gamma} if beta is None else {2: beta, 3: gamma}
    if beta is not None:
        seconds -= beta * rows[:, 2]
    keep = [i for i in range(4) if rows[:, i].any() and i not in known]
    while True:
        a = rows[:, keep] / seconds[:, None]
        x, *_ = np.linalg.lstsq(a, np.ones(len(samples)), rcond=None)
        if (x >= 0).all():
            break
        keep.pop(int(np.argmin(x)))
    values = {**known, **dict(zip(keep, x, strict=True))}
    return Params(*(float(values.get(i, 0.0)) for i in range(4)))


def run(args: argparse.Namespace) -> list[Sample]:
    samples: list[Sample] = []
    for nodes in args.nodes:
        for strategy in args.strategies:
            times = measure(nodes, strategy, args.sizes, args.iters, args.transport)
            for size, seconds in sorted(times.items()):
                if strategy == "auto":  # the exchange up to its limit (the host reduction past)
                    if size > exchange_limit(nodes, one_host=True, host_reduce=True):
                        continue
                    strategy_ = EXCHANGE
                else:
                    strategy_ = parse_strategy(strategy).spec
                samples.append((nodes, strategy_, size, seconds))
                print(f"# measured {nodes} nodes {strategy_:>11} {size:>9} B "
                      f"{seconds * 1e6:9.1f} us", file=sys.stderr, flush=True)
    return samples


def report(samples: Sequence[Sample], cores: int) -> None:
    gamma = reduction_seconds_per_byte()
    walk = fit([s for s in samples if s[1] != EXCHANGE and s[0] == 2], gamma)
    exchange = fit([s for s in samples if s[1] == EXCHANGE and s[0] <= 4], gamma, walk.beta)
    for name, p in (("schedules", walk), ("exchange", exchange)):
        print(f"{name}: alpha {p.alpha * 1e6:.1f} us, overhead {p.overhead * 1e6:.1f} us, "
              f"beta {p.beta * 1e9:.3f} ns/B, gamma {p.gamma * 1e9:.3f} ns/B")
    print(f"\n| nodes | route | bytes | predicted, path (us) | predicted, {cores} cores (us) | "
          "measured (us) | measured / predicted |\n|---|---|---|---|---|---|---|")
    for nodes, route, size, seconds in samples:
        c = route_cost(route, nodes, size)
        p = exchange if route == EXCHANGE else walk
        path, host = c.time(p), c.time(p, cores)
        fitted = " (fitted)" if nodes == 2 or (route == EXCHANGE and nodes <= 4) else ""
        print(f"| {nodes} | {route} | {size} | {path * 1e6:.0f} | {host * 1e6:.0f} | "
              f"{seconds * 1e6:.0f}{fitted} | {seconds / host:.2f} |")
    picks(walk, exchange)
    one_host(samples)


def one_host(samples: Sequence[Sample]) -> None:
    """Where the doubling's work drops below the exchange's among the node processes of one
    host (they share its cores: work, not the critical path, sets the time), from the cost
    of one message of each at the most nodes measured, at the smallest size."""
    nodes, size = max(s[0] for s in samples), min(s[2] for s in samples)
    seconds = {r: t for n, r, s, t in samples if (n, s) == (nodes, size)}
    if EXCHANGE not in seconds or "doubling" not in seconds:
        return
    per = {r: seconds[r] / route_cost(r, nodes, size).messages for r in (EXCHANGE, "doubling")}
    cross = next(n for n in range(2, 4097) if route_cost(EXCHANGE, n, size).messages
                 * per[EXCHANGE] > route_cost("doubling", n, size).messages * per["doubling"])
    print(f"\none host, {nodes} nodes, {size} B: a message costs {per[EXCHANGE] * 1e6:.0f} us "
          f"in the exchange, {per['doubling'] * 1e6:.0f} us in the doubling; the doubling's "
          f"work is the smaller from {cross} nodes")


def picks(walk: Params, exchange: Params) -> None:
    """What the model picks, one node per host (each node its own cores)."""
    sizes = [8, 1 << 10, 32 << 10, 256 << 10, 1 << 20, 16 << 20]
    print("\n| nodes | " + " | ".join(f"{s} B" for s in sizes) + " |\n"
          + "|---" * (len(sizes) + 1) + "|")
    for nodes in (2, 3, 4, 8, 16, 32, 64, 128, 256, 1024):
        best = [min((c for c in CANDIDATES if c != EXCHANGE or size <= exchange_limit(nodes)),
                    key=lambda c: route_cost(c if isinstance(c, str) else c.spec, nodes, size)
                    .time(exchange if c == EXCHANGE else walk)) for size in sizes]
        print(f"| {nodes} | " + " | ".join(b if isinstance(b, str) else b.spec for b in best)
              + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--nodes", default="2,4,8", type=lambda t: [int(x) for x in t.split(",")],
                        help="numbers of node processes, one device each (default 2,4,8; "
                        "at most 8 on a shared machine)")
    parser.add_argument("--sizes", default="8,512,32K,2M",  # a geometric series
                        type=lambda t: [parse_size(x) for x in t.split(",")],
                        help="all-reduce sizes, bytes with K/M/G (default 8,512,32K,2M)")
    parser.add_argument("--strategies", default="centralized,tree,ring,doubling,auto",
                        type=lambda t: t.split(","), help="global strategies to measure")
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per size")
    parser.add_argument("--transport", default="websocket", help="websocket, quic or tcp")
    parser.add_argument("--samples", type=Path, action="append", default=[],
                        help="keep a run's samples in this JSON file; given files that exist "
                        "(one or more runs), report the median of their samples instead")
    args = parser.parse_args()
    runs = [json.loads(p.read_text()) for p in args.samples if p.exists()]
    if not runs:
        runs = [run(args)]
        if args.samples:
            args.samples[0].write_text(json.dumps(runs[0]))
    report(medians(runs), os.cpu_count() or 1)


def medians(runs: Sequence[Sequence[Sequence[object]]]) -> list[Sample]:
    """Each (nodes, route, size)'s median time over ``runs``, in the first run's order."""
    times: dict[tuple[int, str, int], list[float]] = {}
    for samples in runs:
        for n, r, s, t in samples:
            times.setdefault((int(n), str(r), int(s)), []).append(float(t))  # type: ignore
    return [(*key, float(np.median(t))) for key, t in times.items()]


if __name__ == "__main__":
    main()
