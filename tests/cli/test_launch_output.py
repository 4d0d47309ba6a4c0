"""``burncoll launch`` keeps each node's lines whole: a node that dies mid-line (killed, or
exiting without a final newline) does not glue the next node's line to its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_last_line_without_newline_stays_a_line_of_its_own(tmp_path: Path) -> None:
    script = tmp_path / "partial.py"
    script.write_text("import os, sys\nsys.stdout.write('partial'); sys.stdout.flush()\n"
                      "print('second', flush=True) if os.environ['BURNCOLL_NODE_RANK'] == '0' "
                      "else None\nsys.stdout.write('tail'); sys.stdout.flush(); os._exit(0)\n")
    done = subprocess.run([sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2",
                           str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert done.stdout.endswith("\n")
    assert sorted(lines) == sorted(["[node 0] partialsecond", "[node 0] tail",
                                    "[node 1] partialtail"]), lines
