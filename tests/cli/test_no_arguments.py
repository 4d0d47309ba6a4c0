"""``burncoll`` (and ``python -m burncoll``) with no arguments prints the help and exits 0,
as ``--help`` does, rather than an argparse error about a missing command."""

from __future__ import annotations

import subprocess
import sys


def test_no_arguments_prints_the_help_as_help_does() -> None:
    bare = subprocess.run([sys.executable, "-m", "burncoll"], capture_output=True, text=True,
                          timeout=60, check=False)
    helped = subprocess.run([sys.executable, "-m", "burncoll", "--help"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert (bare.returncode, helped.returncode) == (0, 0), bare.stderr + helped.stderr
    assert bare.stdout == helped.stdout and bare.stderr == ""
    for command in ("orchestrator", "launch", "demo", "bench"):
        assert command in bare.stdout
