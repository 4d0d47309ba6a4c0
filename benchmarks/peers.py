"""The peer baselines of ``burncoll bench --vs`` on their own, without burncoll.

    python benchmarks/peers.py --vs gloo,mpi,tcp,numpy --world 4 -b 1K -e 64M

Gloo and MPI all-reduce among ``--world`` processes, TCP loopback both directions busy, and
``np.add``: each timed like ``burncoll bench`` (barrier before each iteration, slowest
participant, median over iterations). Baselines whose library is missing are skipped with a
one-line note.
"""

from __future__ import annotations

import argparse
import sys

from burncoll.bench.options import (
    REDOPS,
    argtype,
    format_size,
    int_at_least,
    parse_dtype,
    parse_size,
    size_sweep,
)
from burncoll.bench.peers import PEER_NAMES, parse_peers, run_peers
from burncoll.bench.results import write_json
from burncoll.bench.table import peer_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vs",
        type=argtype(parse_peers, "peers"),
        default=PEER_NAMES,
        help=f"baselines to run: {','.join(PEER_NAMES)} or all (default all)",
    )
    parser.add_argument(
        "--world", type=int_at_least(1), default=2, help="processes for gloo and mpi"
    )
    parser.add_argument("-b", "--min-bytes", type=argtype(parse_size, "size"), default=8)
    parser.add_argument("-e", "--max-bytes", type=argtype(parse_size, "size"), default=64 * 2**20)
    parser.add_argument("-f", "--factor", type=float, default=2.0)
    parser.add_argument("--dtype", type=argtype(parse_dtype, "dtype"), default="float32")
    parser.add_argument("--redop", choices=REDOPS, default="sum")
    parser.add_argument("-n", "--iters", type=int_at_least(1), default=20)
    parser.add_argument("-w", "--warmup", type=int_at_least(0), default=5)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    try:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"# peer baselines: world {args.world}, {args.dtype} {args.redop}, "
        f"{format_size(sizes[0])} .. {format_size(sizes[-1])}, "
        f"{args.iters} iters + {args.warmup} warm-up",
        flush=True,
    )
    peers = run_peers(args.vs, sizes, args.dtype, args.iters, args.warmup, args.world, args.redop)
    for peer in peers:
        print("\n".join([*peer_table(peer), "#"]), flush=True)
    if args.json:
        write_json(
            args.json,
            [],
            peers,
            {"world": args.world, "dtype": args.dtype, "redop": args.redop, "sizes": sizes},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
