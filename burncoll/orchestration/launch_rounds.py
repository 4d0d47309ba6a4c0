"""The node processes of one ``burncoll launch``, in rounds: started, watched, stopped, restarted.

A round starts one process per node and copies their output
(:mod:`burncoll.orchestration.launch_report`). When one fails, the launcher says so at once
(which node, its exit code, its error); the others get ``grace`` seconds to exit on their own
in the last round (none in a round that is followed by a restart), then are stopped: SIGTERM,
then SIGKILL after :data:`STOP_SECONDS`. A failed run ends with a summary of every node, like
torchrun's.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from burncoll.orchestration.launch_report import (
    NodeOutput,
    Outcome,
    describe,
    failure_line,
    summary,
)

__all__ = ["FAILURE_GRACE", "STOP_SECONDS", "EnvsFor", "exit_code", "run_rounds"]

#: Seconds a node has to exit after SIGTERM before it gets SIGKILL.
STOP_SECONDS = 5.0
#: Seconds the other nodes get to exit on their own once one failed, in the last round: enough
#: to report what they saw (over WebSocket and TCP a lost peer is noticed at once, and the
#: nodes waiting at the orchestrator are told why a node failed before joining), short enough
#: that nobody waits for nodes stuck elsewhere.
FAILURE_GRACE = 5.0
#: Seconds between two looks at the node processes.
_POLL_SECONDS = 0.05

#: Environments of one round, by node rank; called with the restart count.
EnvsFor = Callable[[int], dict[int, dict[str, str]]]


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_rounds(command: Sequence[str], envs_for: EnvsFor, max_restarts: int, grace: float,
               on_failure: Callable[[str], None] = lambda line: None) -> int:
    """Run rounds of the node processes until one succeeds or no restart remains.
    ``on_failure``: told at once when a node of the last round fails (``node 1 failed (exit
    code 3): ...``)."""
    for restart in range(max_restarts + 1):
        last = restart == max_restarts
        failed, outcomes = _run_round(command, envs_for(restart), grace if last else 0.0,
                                      on_failure if last else lambda line: None)
        if failed is None:
            return 0
        code = next(o.returncode for o in outcomes if o.rank == failed)
        if last:
            if max_restarts:
                _say(f"node {failed} exited with {describe(code)}; no restart left "
                     f"({max_restarts} done)")
            _say("\n".join(summary(failed, outcomes, exit_code(code))))
            return exit_code(code)
        _say(f"node {failed} exited with {describe(code)}; restart {restart + 1} of "
             f"{max_restarts}")
    return 0  # pragma: no cover - the last round returns above


def _say(message: str) -> None:
    print(f"burncoll launch: {message}", file=sys.stderr, flush=True)


def _run_round(command: Sequence[str], envs: dict[int, dict[str, str]],
               wait_after_failure: float, on_failure: Callable[[str], None]
               ) -> tuple[int | None, list[Outcome]]:
    """Start one process per node and wait for them: the rank of the first to fail (or ``None``),
    and how each ended. Once one fails, the others get ``wait_after_failure`` seconds before they
    are stopped. Every process is stopped when this returns or raises (an interrupt of the
    launcher)."""
    procs: dict[int, subprocess.Popen[str]] = {}
    outputs: dict[int, tuple[NodeOutput, threading.Thread]] = {}
    stopped: list[int] = []
    try:
        _start(command, envs, procs, outputs)

        def report(rank: int, code: int) -> None:
            output, pump = outputs[rank]
            pump.join(1.0)  # its last lines, its traceback among them
            others = any(p.poll() is None for p in procs.values())
            wait = (f"; the other nodes get {wait_after_failure:g} s to exit, then are stopped"
                    if others and wait_after_failure > 0 else "")
            _say(failure_line(rank, code, output.error) + wait)
            on_failure(failure_line(rank, code, output.error))

        failed = _wait_round(procs, wait_after_failure, report)
        stopped = [rank for rank, proc in procs.items() if proc.poll() is None]
        if failed is not None and stopped:
            why = (f"still running {wait_after_failure:g} s after node {failed} failed"
                   if wait_after_failure > 0 else "to start every node again")
            _say(f"stopping node(s) {', '.join(map(str, stopped))}: {why}")
    finally:
        _stop(list(procs.values()))
        for _, pump in outputs.values():
            pump.join(5)
    return failed, [Outcome(rank, proc.returncode, outputs[rank][0].error, rank in stopped)
                    for rank, proc in procs.items()]


def _start(command: Sequence[str], envs: dict[int, dict[str, str]],
           procs: dict[int, subprocess.Popen[str]],
           outputs: dict[int, tuple[NodeOutput, threading.Thread]]) -> None:
    """Start a process per node into ``procs``, and a thread copying its output."""
    lock = threading.Lock()
    for rank, env in envs.items():
        procs[rank] = proc = subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1)
        output = NodeOutput(rank, sys.stdout, lock)
        pump = threading.Thread(target=output.pump, args=(proc.stdout or (),), daemon=True)
        outputs[rank] = (output, pump)
        pump.start()


def _wait_round(procs: dict[int, subprocess.Popen[str]], wait_after_failure: float,
                report: Callable[[int, int], None]) -> int | None:
    """Wait until every process exited, or ``wait_after_failure`` seconds after a failure,
    which ``report`` is told of at once; the rank of the first to fail."""
    failure: int | None = None
    failed_at = 0.0
    while True:
        running = False
        for rank, proc in procs.items():
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 and failure is None:
                failure, failed_at = rank, time.monotonic()
                report(rank, code)
        if not running:
            return failure
        if failure is not None and time.monotonic() - failed_at >= wait_after_failure:
            return failure
        time.sleep(_POLL_SECONDS)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """Stop the processes still running: SIGTERM, then SIGKILL after :data:`STOP_SECONDS`."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
