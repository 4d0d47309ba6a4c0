"""``burncoll bench --load N``: N CPU-bound processes beside the benchmark, as on a busy
training host (data loaders, Python, the framework). burncoll and the peer baselines run under
the same load, so their ratio says how each copes with busy CPUs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["cpu_load"]

#: What each load process runs: a pure-Python loop, never sleeping, never allocating.
_BUSY = "while True:\n    pass\n"


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """Run ``processes`` CPU-bound processes while the block runs; they are killed after."""
    started = [subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(processes)]
    try:
        yield
    finally:
        for proc in started:
            proc.kill()
        for proc in started:
            proc.wait(timeout=10)
