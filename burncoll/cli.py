"""The ``burncoll`` command: ``orchestrator``, ``launch``, ``bench`` and ``demo``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import TextIO

import burncoll
from burncoll.bench.options import int_at_least
from burncoll.transport import TRANSPORT_NAMES

__all__ = ["main"]


#: Why ``--auth-token VALUE`` is refused.
ARGV_TOKEN_REFUSED = (
    "--auth-token would be visible to every user in /proc/PID/cmdline; use "
    "--auth-token-file PATH or BURNCOLL_AUTH_TOKEN (or BURNCOLL_AUTH_TOKEN_FILE) in the "
    "environment"
)


class _RefuseArgvToken(argparse.Action):
    """``--auth-token``: refused with the reason, rather than an 'unrecognized argument'."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error(ARGV_TOKEN_REFUSED)


def _token(args: argparse.Namespace) -> str | None:
    """The token of ``--auth-token-file``, else of the environment (``BURNCOLL_AUTH_TOKEN``,
    ``BURNCOLL_AUTH_TOKEN_FILE``; both set: they must agree), else ``None``."""
    from burncoll.config.security import resolve_token

    if args.auth_token_file is not None:
        return resolve_token(None, args.auth_token_file)
    return resolve_token(os.environ.get("BURNCOLL_AUTH_TOKEN"),
                         os.environ.get("BURNCOLL_AUTH_TOKEN_FILE") or None)


def _orchestrator(args: argparse.Namespace) -> int:
    from burncoll.orchestration.orchestrator import start_orchestrator

    token = _token(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with start_orchestrator(args.host, args.port, args.transport, token,
                            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                            tls=args.tls, integrity=args.integrity, insecure=args.insecure,
                            expected_nodes=args.nodes) as orchestrator:
        auth = "token authentication" if token is not None else "NO authentication"
        print(f"burncoll orchestrator listening on {orchestrator.address} "
              f"({args.transport}, {auth}); Ctrl-C to stop", flush=True)
        stop.wait()
    return 0


def _launch(args: argparse.Namespace) -> int:
    from burncoll.orchestration.launch import launch_host, launch_nodes

    _check_launch_arguments(args.launch_parser, args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stop the nodes on the way out
    command = [sys.executable, args.script, *args.script_args]
    if args.nnodes is None:
        nodes = args.nodes or args.nproc_per_node or 2
        return launch_nodes(command, nodes, args.devices, args.transport, _token(args),
                            integrity=args.integrity, tls=args.tls,
                            max_restarts=args.max_restarts)
    return launch_host(command, args.nnodes, args.node_rank, args.master_addr,
                       args.master_port, args.devices, args.transport, _token(args),
                       integrity=args.integrity, tls=args.tls, max_restarts=args.max_restarts,
                       node_address=args.node_address, min_nodes=args.min_nodes,
                       min_nodes_wait=args.min_nodes_wait,
                       nproc_per_node=args.nproc_per_node or 1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM to the launcher: unwind (which stops its node processes), exit 128 + 15. A
    second SIGTERM (SLURM and systemd send more than one) must not cut that unwinding short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


#: ``burncoll launch`` options that belong to the multi-host form (``--nnodes``) only.
_HOST_OPTIONS = {"node_rank": "--node-rank", "master_addr": "--master-addr",
                 "master_port": "--master-port", "node_address": "--node-address",
                 "min_nodes": "--min-nodes"}


def _check_launch_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit 2, with the usage) for a launch command line that cannot work."""
    if args.nnodes is None:
        given = [flag for name, flag in _HOST_OPTIONS.items() if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} belong(s) to the multi-host form: add --nnodes N "
                         "(the number of hosts), or leave them out and use --nodes N to run "
                         "every node on this machine")
        if None not in (args.nodes, args.nproc_per_node) and args.nodes != args.nproc_per_node:
            parser.error(f"--nodes {args.nodes} and --nproc-per-node {args.nproc_per_node} "
                         "both count the node processes on this machine: give one of them")
        return
    if args.standalone:
        parser.error("--standalone runs every node on this machine, --nnodes one launcher per "
                     "host: leave out one of them")
    missing = [flag for name, flag in list(_HOST_OPTIONS.items())[:3]
               if getattr(args, name) is None]
    if missing:
        parser.error(f"--nnodes needs {', '.join(missing)}: run the launcher once per host "
                     "with --node-rank R (0 on the master), --master-addr HOST and "
                     "--master-port PORT of the node-rank-0 host")
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes} "
                     f"(ranks 0 to {args.nnodes - 1}, one per host)")
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port {args.master_port}: expected a port in [1, 65535]")
    if args.min_nodes is not None and args.min_nodes > args.nnodes:
        parser.error(f"--min-nodes {args.min_nodes} must be at most --nnodes {args.nnodes}")
    if not args.min_nodes_wait > 0:
        parser.error(f"--min-nodes-wait {args.min_nodes_wait}: expected seconds > 0")


def _demo(args: argparse.Namespace) -> int:
    from burncoll.train.demo import run_demo

    return run_demo(num_devices=args.devices, steps=args.steps, nodes=args.nodes)


def _bench(args: argparse.Namespace) -> int:
    from burncoll.bench.cli import run_bench

    return run_bench(args)


def _add_token_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--auth-token-file", default=None, metavar="PATH",
                        help=f"read the shared token from this file ({default})")
    parser.add_argument("--auth-token", action=_RefuseArgvToken, help=argparse.SUPPRESS)


def _add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--integrity", action="store_true",
                        help="per-message integrity tags (the config's integrity: true; every "
                             "node must agree)")
    parser.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None,
                        help="--tls: wss even without certificates (ephemeral ones); --no-tls: "
                             "plain ws; default automatic (the config's tls field)")


def _add_launch_arguments(launch: argparse.ArgumentParser) -> None:
    form = launch.add_mutually_exclusive_group()
    form.add_argument("--nodes", type=int_at_least(1), default=None,
                      help="run N node processes on this machine (default 2)")
    form.add_argument("--nnodes", type=int_at_least(1), default=None,
                      help="the number of hosts, one node process each (or --nproc-per-node); "
                           "run the launcher on every host")
    launch.add_argument("--node-rank", type=int_at_least(0), default=None,
                        help="with --nnodes: this host's rank, in [0, N) (its node processes' "
                             "node rank; with --nproc-per-node P, theirs are R*P to R*P+P-1)")
    launch.add_argument("--master-addr", default=None,
                        help="with --nnodes: the node-rank-0 host, where the orchestrator runs")
    launch.add_argument("--master-port", type=int, default=None,
                        help="with --nnodes: the orchestrator's port on --master-addr")
    launch.add_argument("--node-address", default=None,
                        help="with --nnodes: the address of this host that the others reach "
                             "(default: the interface that routes to --master-addr)")
    launch.add_argument("--nproc-per-node", "--nproc_per_node", type=int_at_least(1), default=None,
                        metavar="N",
                        help="node processes on this host, as torchrun's: with --nnodes, each "
                             "host runs N (node ranks R*N to R*N+N-1); without, the same as "
                             "--nodes N. Each holds --devices peer threads")
    launch.add_argument("--standalone", action="store_true",
                        help="as torchrun's: every node on this machine (what the form "
                             "without --nnodes does anyway)")
    launch.add_argument("--devices", type=int, default=1,
                        help="devices (peer threads) per node: its BURNCOLL_NUM_DEVICES "
                             "(default 1)")
    launch.add_argument("--max-restarts", type=int_at_least(0), default=0,
                        help="when a node fails, stop this launcher's nodes and start them "
                             "again, up to K times (default 0)")
    launch.add_argument("--min-nodes", type=int_at_least(1), default=None,
                        help="with --nnodes, elastic: go on with at least M hosts when the "
                             "others have not (re)joined within --min-nodes-wait seconds "
                             "(give it on every host; node 0's launcher applies it)")
    launch.add_argument("--min-nodes-wait", type=float, default=30.0, metavar="SECONDS",
                        help="with --min-nodes: how long the missing hosts get once M have "
                             "joined (default 30)")
    launch.add_argument("--transport", choices=TRANSPORT_NAMES, default="websocket",
                        help="how the nodes talk (default websocket)")
    _add_token_arguments(launch, "default: $BURNCOLL_AUTH_TOKEN or $BURNCOLL_AUTH_TOKEN_FILE; "
                                 "else with --nodes a fresh random token for this run, with "
                                 "--nnodes none, which only a loopback --master-addr allows")
    _add_mode_arguments(launch)
    launch.add_argument("script", help="the Python script every node process runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed on to the script")


def _add_orchestrator_arguments(orch: argparse.ArgumentParser) -> None:
    orch.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default loopback; 0.0.0.0 to accept other machines)")
    orch.add_argument("--port", type=int, default=29400,
                      help="port to listen on (default 29400; 0 for a free one, printed)")
    orch.add_argument("--transport", choices=TRANSPORT_NAMES, default="websocket",
                      help="how nodes reach it: the nodes' transport (default websocket)")
    _add_token_arguments(orch, "default: $BURNCOLL_AUTH_TOKEN or $BURNCOLL_AUTH_TOKEN_FILE; "
                               "required unless --host is loopback or --insecure is given")
    orch.add_argument("--insecure", action="store_true",
                      help="allow a non-loopback --host without a token (anyone who reaches "
                           "it can join)")
    orch.add_argument("--nodes", type=int, default=None,
                      help="the number of nodes expected; registrations of another "
                           "num_nodes are refused")
    orch.add_argument("--tls-cert", default=None, help="PEM certificate to present")
    orch.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    orch.add_argument("--tls-ca", default=None,
                      help="PEM CA bundle (as the config's tls_ca; every node must agree)")
    _add_mode_arguments(orch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="burncoll", description="Collective operations over arrays of any backend.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("-V", "--version", action="version",
                        version=f"%(prog)s {burncoll.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    orch = sub.add_parser("orchestrator", help="run the rendezvous server for multi-node runs")
    _add_orchestrator_arguments(orch)
    orch.set_defaults(func=_orchestrator)

    launch = sub.add_parser(
        "launch", help="run a script as node processes: N here, or one per host",
        description="Run a script as node processes, like torchrun. --nodes N: N node "
                    "processes on this machine around a fresh orchestrator (the default, "
                    "--nodes 2). --nnodes N --node-rank R --master-addr HOST --master-port "
                    "PORT: run once per host, each running node R of N; node rank 0 also runs "
                    "the orchestrator on HOST:PORT. Every host then needs the same token "
                    "(BURNCOLL_AUTH_TOKEN or a token file) unless HOST is loopback. Each node "
                    "process also gets torchrun's variables: RANK (its node rank), WORLD_SIZE "
                    "(node processes in all), LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the "
                    "host's rank), MASTER_ADDR and MASTER_PORT (a free port for the script's "
                    "own use).")
    _add_launch_arguments(launch)
    launch.set_defaults(func=_launch, launch_parser=launch)

    demo = sub.add_parser("demo", help="data-parallel training demo on the NumPy backend")
    demo.add_argument("--nodes", type=int, default=1,
                      help="node processes on this machine (default 1)")
    demo.add_argument("--devices", type=int, default=4,
                      help="devices (peer threads) per node (default 4)")
    demo.add_argument("--steps", type=int, default=1000,
                      help="training steps (default 1000)")
    demo.set_defaults(func=_demo)

    try:
        from burncoll.bench.cli import add_arguments
    except ImportError:  # pragma: no cover - the bench module is part of the package
        pass
    else:
        bench = sub.add_parser("bench", help="nccl-tests style benchmark of every operation")
        add_arguments(bench)
        bench.set_defaults(func=_bench)
    return parser


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    print(f"burncoll: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare ``burncoll``: what it can do, not an error about a missing command
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from burncoll.errors import CollectiveError

    try:
        with warnings.catch_warnings():  # as its errors: what to fix, not where in our code
            warnings.showwarning = _show_warning
            code: int = args.func(args)
    except CollectiveError as exc:
        print(f"burncoll: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
