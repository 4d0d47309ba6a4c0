"""The ``burncoll`` command: ``orchestrator``, ``launch``, ``bench`` and ``demo``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

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
    from burncoll.secure_defaults import resolve_token

    if args.auth_token_file is not None:
        return resolve_token(None, args.auth_token_file)
    return resolve_token(os.environ.get("BURNCOLL_AUTH_TOKEN"),
                         os.environ.get("BURNCOLL_AUTH_TOKEN_FILE") or None)


def _orchestrator(args: argparse.Namespace) -> int:
    from burncoll.orchestrator import start_orchestrator

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
    from burncoll.launch import launch_nodes

    command = [sys.executable, args.script, *args.script_args]
    return launch_nodes(command, args.nodes, args.devices, args.transport, _token(args),
                        integrity=args.integrity, tls=args.tls)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="burncoll", description="Collective operations over arrays of any backend.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    orch = sub.add_parser("orchestrator", help="run the rendezvous server for multi-node runs")
    orch.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default loopback; 0.0.0.0 to accept other machines)")
    orch.add_argument("--port", type=int, default=29400)
    orch.add_argument("--transport", choices=TRANSPORT_NAMES, default="websocket")
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
    orch.set_defaults(func=_orchestrator)

    launch = sub.add_parser("launch", help="run a script as N local node processes")
    launch.add_argument("--nodes", type=int, default=2)
    launch.add_argument("--devices", type=int, default=1)
    launch.add_argument("--transport", choices=TRANSPORT_NAMES, default="websocket")
    _add_token_arguments(launch, "default: $BURNCOLL_AUTH_TOKEN or $BURNCOLL_AUTH_TOKEN_FILE, "
                                 "else a fresh random token for this run")
    _add_mode_arguments(launch)
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
