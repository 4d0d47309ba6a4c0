"""examples/train_anywhere.py under launcher variables set by hand: SLURM's (no srun here),
and torchrun's when they don't add up. The real launchers run the example's documented
commands in test_example_commands.py; the final parameters must equal a single-process
float64 run."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launchers.common import (
    EXAMPLE,
    assert_trained,
    clean_env,
    run,
)

pytestmark = pytest.mark.slow
STEPS = 20


def _script(result: Path, *more: str) -> list[str]:
    return [str(EXAMPLE), "--devices", "1", "--steps", str(STEPS), "--result", str(result),
            *more]


def test_slurm_variables(tmp_path: Path) -> None:
    """Two tasks of an srun step on one host, as SLURM sets their variables."""
    result = tmp_path / "r.json"
    job = str(random.randrange(10_000, 10_000_000))
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_JOB_ID=job, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0", SLURM_NNODES="1",
                        SLURM_JOB_NODELIST="localhost", SLURM_TASKS_PER_NODE="2")
        procs.append(subprocess.Popen([sys.executable, *_script(result)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert_trained(result, STEPS, nodes=2)


def test_launcher_variables_that_do_not_add_up_are_an_error(tmp_path: Path) -> None:
    """Never a silent world of one: RANK beyond WORLD_SIZE stops the script with the names."""
    env = clean_env(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    proc = run([sys.executable, *_script(tmp_path / "r.json")], env, timeout=60)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "RANK" in proc.stderr
    assert "WORLD_SIZE" in proc.stderr
    assert not (tmp_path / "r.json").exists()
