"""The attacks of issue 11 at full size, on a live collective; prints a table for the README.

    python benchmarks/attacks.py            # the issue's sizes (several minutes)
    python benchmarks/attacks.py --quick    # the test suite's sizes
    python benchmarks/attacks.py --objects-only   # a member's hostile objects (issue 33)

Each attack runs against a live collective (an orchestrator process and 2 member nodes x 2
devices looping over all-reduces checked exactly against NumPy float64; see
``tests/security/victims.py``) from another loopback address, and is measured alone: the
attacked process's peak RSS growth (``VmRSS``), and what the legitimate operations saw
(how many ran during the attack, wrong results, failures). An attack stops early when the
victim grows past its safety ceiling (the table says so). A man in the middle holding no token
runs against each transport mode. A member holding the token sends hostile object records
(``tests/security/test_hostile_objects.py``, at the issue's sizes: the test's). Prints a
Markdown table:

    attack | transport | target | memory growth (bound) | legitimate ops affected
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.security import attacks as a  # noqa: E402
from tests.security import test_attacks as suite  # noqa: E402
from tests.security import test_hostile_objects as hostile_objects  # noqa: E402
from tests.security.victims import (  # noqa: E402
    LiveCollective,
    Measured,
    MiB,
    Settings,
    measure,
    summarize,
)


@dataclass(frozen=True)
class Sizes:
    pipelined: int
    pipelined_send: int
    fragment_connections: int
    idle: int
    quic_connections: int
    initial_packets: int
    initial_seconds: float
    hold: float


FULL = Sizes(pipelined=1000, pipelined_send=64 * MiB, fragment_connections=1000, idle=1100,
             quic_connections=100, initial_packets=6500, initial_seconds=5.0, hold=8.0)
QUICK = Sizes(pipelined=suite.PIPELINED_CONNECTIONS, pipelined_send=suite.PIPELINED_SEND,
              fragment_connections=suite.FRAGMENT_CONNECTIONS, idle=suite.IDLE_CONNECTIONS,
              quic_connections=suite.QUIC_CONNECTIONS, initial_packets=suite.INITIAL_PACKETS,
              initial_seconds=suite.INITIAL_SECONDS, hold=suite.HOLD)

Row = tuple[str, str, str, str, str]


def _affected(m: Measured | None, summary: dict[str, Any]) -> str:
    during = "" if m is None else f"{m.ops_during} ran during it; "
    wrong = summary["wrong"]
    failed = "none failed" if summary["ok"] else f"failed: {', '.join(summary['errors'])}"
    return f"{during}{wrong} wrong; {failed}; slowest {summary['slowest']:.2f} s"


def _growth(m: Measured) -> str:
    stopped = " (stopped at the ceiling)" if m.report.stopped_by_alarm else ""
    verdict = "ok" if m.growth <= m.bound and not m.report.stopped_by_alarm else "OVER"
    return (f"+{m.growth / MiB:.0f} MiB{stopped} (bound {m.bound / MiB:.0f}: {verdict}); "
            f"{m.report.dropped}/{m.report.opened} dropped, {m.report.refused} refused")


def _attack_list(transport: str, sizes: Sizes, loop: a.BackgroundLoop, port: int, target: str
                 ) -> list[tuple[str, Callable[[Any], Any], int]]:
    if transport == "quic":
        packets = a.initial_packets(port, sizes.initial_packets)
        return [
            (f"12-byte prefix announcing 64 MiB x {sizes.quic_connections}",
             lambda al: loop.run(a.quic_length_prefix(port, target, sizes.quic_connections, al,
                                                      hold=sizes.hold)),
             suite.quic_bound(sizes.quic_connections)),
            (f"STREAM frame at the window's edge x {sizes.quic_connections}",
             lambda al: loop.run(a.quic_stream_offset(port, target, sizes.quic_connections, al,
                                                      hold=sizes.hold)),
             suite.quic_bound(sizes.quic_connections)),
            (f"{sizes.initial_packets} Initial packets in {sizes.initial_seconds:g} s",
             lambda al: loop.run(a.quic_initial_flood(port, target, packets,
                                                      sizes.initial_seconds, al, hold=sizes.hold)),
             suite.BASE + suite.INITIAL_FLOOD),
        ]
    rows: list[tuple[str, Callable[[Any], Any], int]] = [
        (f"header pipelined, 64 MiB announced x {sizes.pipelined}",
         lambda al: loop.run(a.stream_pipelined(transport, port, target, sizes.pipelined, al,
                                                send_cap=sizes.pipelined_send, hold=sizes.hold)),
         suite.pipelined_bound(sizes.pipelined)),
    ]
    if transport == "websocket":
        rows.append((f"{suite.FRAGMENTS} empty fragments x {sizes.fragment_connections}",
                     lambda al: loop.run(a.ws_fragments(port, target, sizes.fragment_connections,
                                                        al, hold=sizes.hold)),
                     suite.pipelined_bound(sizes.fragment_connections)))
    rows.append((f"{sizes.idle} idle connections",
                 lambda al: loop.run(a.idle_flood(port, target, sizes.idle, al, hold=sizes.hold)),
                 suite.idle_bound(sizes.idle)))
    return rows


def preauth_rows(transport: str, sizes: Sizes) -> list[Row]:
    """Every pre-authentication attack on ``transport``, on the node and on the orchestrator,
    each on a fresh live collective (so that one attack's leftovers do not count for the next)."""
    rows: list[Row] = []
    count = 3 if transport in ("quic", "websocket") else 2
    for index in range(count):
        for target in suite.TARGETS:
            settings = Settings(transport=transport, devices=2, timeout=suite.TIMEOUT)
            with LiveCollective(settings) as live, a.BackgroundLoop() as loop:
                port, pid = suite._targets(live)[target]
                live.wait_progress(10, suite.TIMEOUT)
                name, attack, bound = _attack_list(transport, sizes, loop, port, target)[index]
                m = measure(live, pid, attack, bound)
                summary = summarize(live.finish(suite.TIMEOUT * 3))
            rows.append((name, transport, target, _growth(m), _affected(m, summary)))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def relay_rows() -> list[Row]:
    modes = [("quic", {}), ("websocket", {"tls": True}), ("tcp", {"integrity": True}),
             ("websocket", {"integrity": True}), ("tcp", {}), ("websocket", {})]
    rows: list[Row] = []
    for transport, config in modes:
        mode = transport + "".join(f" {k}" for k in config)
        try:
            run = suite.relay_run(transport, config)
            summary = summarize(run.done)
            growth = f"relay flipped {run.flipped} of {run.forwarded} messages"
            rows.append(("man in the middle, no token", mode, "node 1 -> node 0", growth,
                         _affected(None, summary)))
        except AssertionError as exc:
            rows.append(("man in the middle, no token", mode, "node 1 -> node 0", "-",
                         f"harness failed: {str(exc)[:200]}"))
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


#: What each hostile object record is, for the table.
OBJECT_ATTACKS = {
    "empty_lists": "an 8 MiB object record of empty lists",
    "short_strings": "an 8 MiB object record of 2-character strings",
    "colliding_keys": "a dict of 40,000 tuple keys sharing one hash (727 KB)",
    "bool_byte_2": "a bool array carrying 0x02",
    "deep": "lists nested 1,048,576 deep (1 MiB)",
    "declared": "1,000 nested lists declaring 16,000 items each, in 16 KB",
}


def object_rows() -> list[Row]:
    """A member (node 1 of 3) sends each hostile object record in an ``all_gather_object``."""
    run = hostile_objects._hostile_run()
    controls = all(r["ok"] for r in run["control"] + run["done"])
    rows: list[Row] = []
    for kind, what in OBJECT_ATTACKS.items():
        got = sorted((r for r in run["attack"] if r["kind"] == kind), key=lambda r: r["node"])
        honest = [r for r in got if r["node"] != hostile_objects.LIAR]
        growth = " / ".join(f"+{r['growth_mb']:.0f}" for r in honest)
        named = all(r["error"] == "ProtocolError" and "from peer 1" in r["message"]
                    for r in got)
        slowest = max((r["elapsed"] for r in got), default=float("nan"))
        rows.append((what, "websocket", "the 2 honest members", f"{growth} MiB (100)",
                     f"{'ProtocolError naming node 1' if named else 'NOT refused'} on all "
                     f"{len(got)} members within {slowest:.2f} s (timeout "
                     f"{hostile_objects.TIMEOUT:.0f} s); honest objects before and after: "
                     f"{'exact' if controls else 'WRONG'}"))
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's sizes")
    parser.add_argument("--transports", default="tcp,websocket,quic")
    parser.add_argument("--no-relay", action="store_true", help="skip the man in the middle")
    parser.add_argument("--objects-only", action="store_true",
                        help="only a member's hostile objects")
    args = parser.parse_args()
    a.raise_nofile()
    sizes = QUICK if args.quick else FULL
    started = time.monotonic()
    rows: list[Row] = []
    for transport in [] if args.objects_only else args.transports.split(","):
        rows.extend(preauth_rows(transport, sizes))
    if not (args.no_relay or args.objects_only):
        rows.extend(relay_rows())
    rows.extend(object_rows())
    print("| attack | transport | target | memory growth (bound) | legitimate ops affected |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n({time.monotonic() - started:.0f} s; sizes: {sizes})")


if __name__ == "__main__":
    main()
