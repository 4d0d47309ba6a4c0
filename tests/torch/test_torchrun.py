"""Under real torchrun (``--nproc-per-node 2``): the documented command of
examples/torch_ddp.py trains with DDP on burncoll and its replicas end identical."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torch.processes import REPO, RUN_SECONDS, environment, free_port

pytest.importorskip("torch")


@pytest.mark.slow
def test_example_under_torchrun() -> None:
    doc = (REPO / "examples" / "torch_ddp.py").read_text().split('"""')[1]
    command = next(line.split() for line in doc.splitlines()
                   if line.strip().startswith("torchrun") and "--backend" not in line)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None, "torchrun comes with torch"
    done = subprocess.run(
        [torchrun, "--master-port", str(free_port()), *command[1:], "--steps", "3"],
        cwd=REPO, env=environment(), text=True, capture_output=True, timeout=RUN_SECONDS,
        check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend burncoll, 2 ranks, replicas identical: yes" in done.stdout, done.stdout
