"""What ``burncoll launch`` makes of a node's output (no processes: the lines a node prints).

The error a node ended with is the exception line of its last traceback (a chained exception's
last, the one the process died of), else its last line of output; each line is copied with
the node's prefix; the summary names the first failure first.
"""

from __future__ import annotations

import io
import threading

from burncoll.orchestration.launch_report import NodeOutput, Outcome, failure_line, summary


def output_of(text: str) -> tuple[NodeOutput, str]:
    sink = io.StringIO()
    node = NodeOutput(3, sink, threading.Lock())
    node.pump(io.StringIO(text))
    return node, sink.getvalue()


CHAINED = """step 1
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    load()
KeyError: 'weights'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "train.py", line 5, in <module>
    raise RuntimeError("no checkpoint") from exc
RuntimeError: no checkpoint
[W] a warning after it
"""


def test_the_error_is_the_exception_of_the_last_traceback() -> None:
    node, copied = output_of(CHAINED)
    assert node.error == "RuntimeError: no checkpoint"
    assert copied.splitlines() == [f"[node 3] {line}" for line in CHAINED.splitlines()]


def test_without_a_traceback_the_error_is_the_last_line_of_output() -> None:
    node, copied = output_of("loading\nbad input file: data.npz\n\n")
    assert node.error == "bad input file: data.npz"
    node, copied = output_of("partial")  # killed mid-line: the line still ends
    assert (node.error, copied) == ("partial", "[node 3] partial\n")
    assert output_of("")[0].error is None


def test_a_huge_line_is_cut_in_the_error() -> None:
    node, _ = output_of("Traceback (most recent call last):\nValueError: " + "x" * 10_000 + "\n")
    assert node.error is not None and node.error.startswith("ValueError: xxx")
    assert len(node.error) == 500


def test_the_summary_puts_the_first_failure_first() -> None:
    outcomes = [Outcome(0, -15, "waiting", True), Outcome(1, 0, None, False),
                Outcome(2, 3, "ValueError: no", False)]
    assert summary(2, outcomes, 3) == [
        "FAILED with exit code 3; node 2 failed first",
        "  node 2 (first failure): exit code 3: ValueError: no",
        "  node 0: stopped by the launcher (exit code -15 (SIGTERM))",
        "  node 1: exit code 0",
    ]
    assert failure_line(1, -9, None) == "node 1 failed (exit code -9 (SIGKILL))"
