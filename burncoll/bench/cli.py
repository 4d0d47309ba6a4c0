"""``burncoll bench``: the options, and the glue from them to the runner, peers and output.

With ``--nodes N > 1`` the command runs itself as the node script of
:func:`burncoll.orchestration.launch.launch_nodes` (``--bench-node FILE``): node 0 writes its
rows to FILE and this process prints them. Peer baselines run here first, so each row can be
printed with its ratios as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from burncoll.bench.load import cpu_load
from burncoll.bench.options import (
    ALL_OPS,
    BENCH_DTYPES,
    REDOPS,
    argtype,
    format_size,
    int_at_least,
    parse_dtype,
    parse_ops,
    parse_size,
    size_sweep,
)
from burncoll.bench.peers import PEER_NAMES, parse_peers, run_peers
from burncoll.bench.plot import MISSING_MATPLOTLIB, matplotlib_missing, plot_busbw
from burncoll.bench.results import TIMING_METHOD, PeerResult, Row, write_json
from burncoll.bench.runner import BenchSpec, run_node
from burncoll.bench.table import banner, body, closing, peer_table, ratio_peers, row_lines
from burncoll.config import CollectiveConfig
from burncoll.transport import TRANSPORT_NAMES

__all__ = ["add_arguments", "build_config", "run_bench"]

_LOCAL = ("local_all_reduce_strategy", "local_reduce_strategy", "local_broadcast_strategy")
_GLOBAL = ("global_all_reduce_strategy", "global_reduce_strategy", "global_broadcast_strategy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``burncoll bench`` (see ``burncoll bench --help``)."""
    parser.description = (
        "nccl-tests style benchmark of burncoll's collectives on the NumPy (or configured) "
        "backend; every result is checked against a NumPy float64 reference. Timing: "
        + TIMING_METHOD
    )
    _add_workload(parser)
    _add_topology(parser)
    _add_measurement(parser)


def _add_workload(parser: argparse.ArgumentParser) -> None:
    """What is measured: operations, sizes, dtype, reduce op, root."""
    add = parser.add_argument
    add("--op", type=argtype(parse_ops, "op"), default=("all_reduce",),
        help=f"comma-separated list of {','.join(ALL_OPS)}, or 'all' (default: all_reduce)")
    add("-b", "--min-bytes", type=argtype(parse_size, "size"), default=8,
        help="smallest size, bytes with optional K/M/G suffix (default 8)")
    add("-e", "--max-bytes", type=argtype(parse_size, "size"), default=64 * 2**20,
        help="largest size (default 64M)")
    add("-f", "--factor", type=float, default=2.0,
        help="multiplication factor between sizes (default 2)")
    add("--dtype", type=argtype(parse_dtype, "dtype"), default="float32",
        help=f"element type: {', '.join(BENCH_DTYPES)} (default float32)")
    add("--redop", choices=REDOPS, default="sum", help="reduce operation (default sum)")
    add("--root", type=int_at_least(0), default=0,
        help="root peer id of reduce and broadcast (default 0)")


def _add_topology(parser: argparse.ArgumentParser) -> None:
    """Where it runs: peers, nodes, strategies, transport, config file."""
    add = parser.add_argument
    add("-g", "--devices", type=int_at_least(1), default=None,
        help="local peers (threads) per node (default: the config's, else 2)")
    add("--nodes", type=int_at_least(1), default=1,
        help="node processes on this machine, through burncoll launch")
    add("--strategy", default=None,
        help="every local and global strategy: centralized, tree, tree:K, ring "
             "(doubling: --global-strategy only, it runs between nodes)")
    add("--local-strategy", default=None, help="the three local strategies")
    add("--global-strategy", default=None,
        help="the three global strategies: those of --strategy or doubling")
    add("--transport", choices=TRANSPORT_NAMES, default=None,
        help="node-to-node transport with --nodes (default: config's)")
    add("--config", default=None,
        help="YAML CollectiveConfig; the flags above override it, BURNCOLL_* variables both")


def _add_measurement(parser: argparse.ArgumentParser) -> None:
    """How it is measured and reported: iterations, baselines, outputs."""
    add = parser.add_argument
    add("-n", "--iters", type=int_at_least(1), default=20,
        help="timed iterations per size (default 20)")
    add("-w", "--warmup", type=int_at_least(0), default=5,
        help="untimed iterations per size before them (default 5)")
    add("--vs", type=argtype(parse_peers, "peers"), default=(),
        help=f"peer baselines to run too: {','.join(PEER_NAMES)} or all; each adds a column "
        "'vs PEER (x)': its time / burncoll's (above 1, burncoll is faster)")
    add("--fresh-results", action="store_true",
        help="all_reduce returns a new array per call; by default it writes into an out= array "
        "allocated once, as nccl-tests and mpi4py's Allreduce measure")
    add("--load", type=int_at_least(0), default=0,
        help="run N CPU-bound processes beside the benchmark and the peer baselines (a busy "
        "host); default 0")
    add("--compression", choices=("bf16", "fp16"), default=None,
        help="all_reduce sends 16-bit values between nodes (burncoll.compression)")
    add("--json", default=None, help="write rows and environment to this file")
    add("--plot", default=None, help="write busbw vs size to this PNG")
    add("--bench-node", default=None, help=argparse.SUPPRESS)


def build_config(args: argparse.Namespace, multi_node: bool) -> CollectiveConfig:
    """The CollectiveConfig of ``--config`` with the flags applied (env vars still win)."""
    base = CollectiveConfig.from_yaml(args.config) if args.config else CollectiveConfig()
    changes: dict[str, Any] = {}
    if args.devices is not None:
        changes["num_devices"] = args.devices
    elif args.config is None:
        changes["num_devices"] = 2
    if args.transport is not None:
        changes["transport"] = args.transport
    if getattr(args, "compression", None) is not None:
        changes["compression"] = args.compression
    for value, names in ((args.strategy, _LOCAL + _GLOBAL), (args.local_strategy, _LOCAL),
                         (args.global_strategy, _GLOBAL)):
        if value is not None:
            changes.update(dict.fromkeys(names, value))
    if not multi_node:
        changes["num_nodes"] = None
    return base.replace(**changes)


def _node_argv(args: argparse.Namespace, result_path: str) -> list[str]:
    """The command each node process runs: this benchmark, as one node."""
    argv = [sys.executable, "-m", "burncoll.cli", "bench", "--op", ",".join(args.op),
            "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
            "--factor", repr(args.factor), "--dtype", args.dtype, "--redop", args.redop,
            "--root", str(args.root), "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--bench-node", result_path]
    if args.fresh_results:
        argv.append("--fresh-results")
    for flag, value in (("--compression", args.compression), ("--devices", args.devices),
                        ("--strategy", args.strategy), ("--local-strategy", args.local_strategy),
                        ("--global-strategy", args.global_strategy),
                        ("--transport", args.transport), ("--config", args.config)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _settings(args: argparse.Namespace, config: CollectiveConfig,
              sizes: list[int]) -> dict[str, Any]:
    world = config.num_devices * args.nodes
    settings: dict[str, Any] = {
        "ops": ",".join(args.op),
        "sizes": f"{format_size(sizes[0])} .. {format_size(sizes[-1])} "
        f"(x{args.factor:g}, {len(sizes)} sizes)",
        "dtype": args.dtype,
        "redop": args.redop,
        "root": args.root,
        "world": f"{world} peers = {args.nodes} node(s) x {config.num_devices} device(s)",
        "backend": config.backend,
        "local strategies (all_reduce/reduce/broadcast)": "/".join(
            config.strategy(n).spec for n in _LOCAL
        ),
        "iters": f"{args.iters} timed + {args.warmup} warm-up per size; time = median over "
        "iterations of the slowest peer, barrier before each",
        "all_reduce results": "a new array per call" if args.fresh_results else
        "written into an out= array allocated once (nccl-tests' out-of-place)",
        "cpus": os.cpu_count(),
        "load": f"{args.load} CPU-bound processes beside the benchmark and the peers"
        if args.load else "none",
    }
    if args.compression:
        settings["compression"] = f"{args.compression} between nodes"
    if args.nodes > 1:
        settings["global strategies (all_reduce/reduce/broadcast)"] = "/".join(
            config.strategy(n).spec for n in _GLOBAL
        )
        settings["transport"] = config.transport
    return settings


def _print(lines: list[str]) -> None:
    if lines:
        print("\n".join(lines), flush=True)


class _Stream:
    """Prints rows as they arrive, with a header whenever the operation changes."""

    def __init__(self, peers: list[PeerResult]) -> None:
        self.columns = ratio_peers(peers)
        self.previous: str | None = None

    def __call__(self, row: Row) -> None:
        _print(row_lines(row, self.previous, self.columns))
        self.previous = row.op


def _run_node_mode(args: argparse.Namespace, spec: BenchSpec) -> int:
    config = build_config(args, multi_node=True)
    node_rank = int(os.environ.get("BURNCOLL_NODE_RANK", "0") or 0)
    rows = run_node(spec, config, node_rank)
    if rows:
        Path(args.bench_node).write_text(json.dumps([row.to_dict() for row in rows]))
    return 0


def _run_multi_node(args: argparse.Namespace, spec: BenchSpec,
                    config: CollectiveConfig) -> list[Row] | int:
    from burncoll.orchestration.launch import launch_nodes

    with tempfile.TemporaryDirectory(prefix="burncoll-bench-") as tmp:
        result_path = os.path.join(tmp, "rows.json")
        code = launch_nodes(_node_argv(args, result_path), args.nodes, config.num_devices,
                            config.transport, config.auth_token, integrity=config.integrity,
                            tls=config.tls)
        if code != 0:
            print(f"burncoll bench: error: a node process failed (exit code {code})",
                  file=sys.stderr)
            return code
        try:
            raw = json.loads(Path(result_path).read_text())
        except (OSError, ValueError) as exc:
            print(f"burncoll bench: error: node 0 left no results ({exc})", file=sys.stderr)
            return 1
    return [Row.from_dict(item) for item in raw]


def run_bench(args: argparse.Namespace) -> int:
    """Run ``burncoll bench``; 0 when every result was correct, 1 otherwise, 2 on misuse."""
    try:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        print(f"burncoll bench: error: {exc}", file=sys.stderr)
        return 2
    spec = BenchSpec(tuple(args.op), tuple(sizes), args.dtype, args.redop, args.root,
                     args.iters, args.warmup, args.fresh_results)
    if args.bench_node is not None:
        return _run_node_mode(args, spec)
    if args.plot and matplotlib_missing():
        print(f"burncoll bench: error: {MISSING_MATPLOTLIB}", file=sys.stderr)
        return 2
    config = build_config(args, multi_node=args.nodes > 1)
    world = config.num_devices * args.nodes
    if args.root >= world:
        print(f"burncoll bench: error: --root {args.root} is not a peer id; the {world} "
              f"peers are 0..{world - 1}", file=sys.stderr)
        return 2
    settings = _settings(args, config, sizes)
    _print(banner(settings))
    with cpu_load(args.load):
        measured = _measure(args, spec, config, sizes, world)
    if isinstance(measured, int):
        return measured
    rows, peers = measured
    if args.json:
        recorded = {
            **settings,
            "nodes": args.nodes,
            "devices": config.num_devices,
            "world_size": world,
            "config": config.to_dict(),  # the token never appears
            "argv": sys.argv,
        }
        write_json(args.json, rows, peers, recorded)
    if args.plot:
        plot_busbw(args.plot, rows, peers, f"burncoll bench: {settings['world']}")
    return 0 if all(row.wrong == 0 for row in rows) else 1


def _measure(args: argparse.Namespace, spec: BenchSpec, config: CollectiveConfig,
             sizes: list[int], world: int) -> tuple[list[Row], list[PeerResult]] | int:
    """The peer baselines, then burncoll; its rows and theirs (an exit code on failure)."""
    peers: list[PeerResult] = []
    if args.vs:
        _print([f"# running peer baselines first: {', '.join(args.vs)}"])
        peers = run_peers(args.vs, sizes, args.dtype, args.iters, args.warmup, world, args.redop)
        _print([line for peer in peers if peer.skipped for line in peer_table(peer)])
    if args.nodes > 1:
        outcome = _run_multi_node(args, spec, config)
        if isinstance(outcome, int):
            return outcome
        rows = outcome
        _print(body(rows, peers, skipped=False))
    else:
        stream = _Stream(peers)
        rows = run_node(spec, config, 0, on_row=stream)
        _print(closing(rows, peers, skipped=False))
    return rows, peers
