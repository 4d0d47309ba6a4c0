"""Running one step of a local attack in a child process: its result, peak memory growth and
time, never a hang (the child is killed at a timeout)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: The memory growth any of these attacks may cost (the issue measured 0.5-8.5 GB).
MAX_GROWTH_MIB = 100
#: Far beyond what any case needs here; a hang is what it catches.
CHILD_TIMEOUT = 60.0

_PRELUDE = """
import json, resource, sys, time
{imports}
def _peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
before, start = _peak(), time.monotonic()
try:
    value, error = repr(({call})), None
except Exception as exc:
    value, error = None, [type(exc).__name__, str(exc)]
print(json.dumps({{"value": value, "error": error, "growth_mib": _peak() - before,
                  "seconds": time.monotonic() - start}}))
"""


def in_child(imports: str, call: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``call`` (a Python expression) after ``imports`` in a fresh interpreter; what it
    returned (``repr``) or raised, its peak memory growth in MiB and its seconds."""
    base = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE.format(imports=imports, call=call)],
                          env={**base, **(env or {})}, cwd=REPO, capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
