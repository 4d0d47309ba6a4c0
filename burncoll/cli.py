"""The ``burncoll`` command: ``orchestrator``, ``launch``, ``bench`` and ``demo``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from burncoll.config import TRANSPORTS

__all__ = ["main"]


def _orchestrator(args: argparse.Namespace) -> int:
    from burncoll.orchestrator import start_orchestrator

    token = args.auth_token or os.environ.get("BURNCOLL_AUTH_TOKEN")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with start_orchestrator(args.host, args.port, args.transport, token,
                            tls_cert=args.tls_cert, tls_key=args.tls_key) as orchestrator:
        print(f"burncoll orchestrator listening on {orchestrator.address} "
              f"({args.transport}); Ctrl-C to stop", flush=True)
        stop.wait()
    return 0


def _launch(args: argparse.Namespace) -> int:
    from burncoll.launch import launch_nodes

    command = [sys.executable, args.script, *args.script_args]
    return launch_nodes(command, args.nodes, args.devices, args.transport,
                        args.auth_token or os.environ.get("BURNCOLL_AUTH_TOKEN"))


def _demo(args: argparse.Namespace) -> int:
    from burncoll.train.demo import run_demo

    return run_demo(num_devices=args.devices, steps=args.steps, nodes=args.nodes)


def _bench(args: argparse.Namespace) -> int:
    from burncoll.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="burncoll", description="Collective operations over arrays of any backend.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    orch = sub.add_parser("orchestrator", help="run the rendezvous server for multi-node runs")
    orch.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default loopback; 0.0.0.0 to accept other machines)")
    orch.add_argument("--port", type=int, default=29400)
    orch.add_argument("--transport", choices=TRANSPORTS, default="websocket")
    orch.add_argument("--auth-token", default=None,
                      help="shared secret (default: $BURNCOLL_AUTH_TOKEN)")
    orch.add_argument("--tls-cert", default=None)
    orch.add_argument("--tls-key", default=None)
    orch.set_defaults(func=_orchestrator)

    launch = sub.add_parser("launch", help="run a script as N local node processes")
    launch.add_argument("--nodes", type=int, default=2)
    launch.add_argument("--devices", type=int, default=1)
    launch.add_argument("--transport", choices=TRANSPORTS, default="websocket")
    launch.add_argument("--auth-token", default=None)
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    launch.set_defaults(func=_launch)

    demo = sub.add_parser("demo", help="data-parallel training demo on the NumPy backend")
    demo.add_argument("--nodes", type=int, default=1)
    demo.add_argument("--devices", type=int, default=4)
    demo.add_argument("--steps", type=int, default=1000)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from burncoll.errors import CollectiveError

    try:
        code: int = args.func(args)
    except CollectiveError as exc:
        print(f"burncoll: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
