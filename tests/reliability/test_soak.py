"""The soak's short version: random operations back to back on 3 nodes x 2 devices, each
result checked against a float64 reference (``benchmarks/soak.py``; the full run is 10,000).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.parametrize(
    ("transport", "local", "global_", "seed"),
    [
        ("websocket", "tree", "ring", 11),
        ("quic", "ring", "centralized", 12),
    ],
)
def test_short_soak_has_no_failure(
    transport: str, local: str, global_: str, seed: int, tmp_path: Path
) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--ops",
            "150",
            "--transport",
            transport,
            "--local",
            local,
            "--global",
            global_,
            "--seed",
            str(seed),
            "--timeout",
            "30",
            "--json",
            str(out),
            # 150 operations are too few for the allocator to settle: memory is the full run's
            "--max-rss-growth",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["completed"] == 150 and summary["failures"] == 0, summary
    assert "failures: 0" in done.stdout
    assert len(summary["rss_kib"]) == 3
