"""The same script (examples/train_anywhere.py) under every launcher, checked against NumPy.

Each launcher starts real processes that find each other from the launcher's own variables
(nothing ``BURNCOLL_*``), node 0 hosting the rendezvous; the final parameters must equal a
single-process float64 run. The launchers that are not installed are skipped with a reason.
"""

from __future__ import annotations

import os
import random
import shutil
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


def _torchrun() -> str | None:
    sibling = Path(sys.executable).with_name("torchrun")
    return str(sibling) if sibling.exists() else shutil.which("torchrun")


def _mpirun() -> list[str] | None:
    found = shutil.which("mpirun")
    if found is None:
        return None
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [found, *root, "--oversubscribe"]


def _script(result: Path, *more: str) -> list[str]:
    return [str(EXAMPLE), "--devices", "1", "--steps", str(STEPS), "--result", str(result),
            *more]


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_plain_python_is_one_node(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    _ok(run([sys.executable, *_script(result)], clean_env()))
    assert_trained(result, STEPS, nodes=1)


def test_burncoll_launch(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    proc = run([sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2",
                *_script(result)], clean_env())
    _ok(proc)
    assert_trained(result, STEPS, nodes=2)


def test_torchrun(tmp_path: Path) -> None:
    torchrun = _torchrun()
    if torchrun is None:
        pytest.skip("torchrun is not installed (it comes with torch, the [bench] extra)")
    result = tmp_path / "r.json"
    proc = run([torchrun, "--standalone", "--nproc-per-node", "2", *_script(result)],
               clean_env(OMP_NUM_THREADS="1"))
    _ok(proc)
    assert_trained(result, STEPS, nodes=2)


def test_mpirun(tmp_path: Path) -> None:
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("mpirun is not installed (Open MPI: apt-get install openmpi-bin)")
    result = tmp_path / "r.json"
    proc = run([*mpirun, "-np", "2", sys.executable, *_script(result)], clean_env())
    _ok(proc)
    assert_trained(result, STEPS, nodes=2)


def test_slurm_variables(tmp_path: Path) -> None:
    """Two tasks of an srun step on one host, as SLURM sets their variables."""
    result = tmp_path / "r.json"
    job = str(random.randrange(10_000, 10_000_000))
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_JOB_ID=job, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_NTASKS="2", SLURM_NODEID="0", SLURM_NNODES="1",
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
