"""Every command in the docstring of examples/train_anywhere.py runs as written -- plain
python, burncoll launch, torchrun, mpirun, srun; those not installed here are skipped with a
reason -- and every node ends with the loss of single-process float64 descent;
examples/slurm/train.sbatch is a valid bash script whose srun line runs that same script."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launchers.common import EXAMPLE, REPO, clean_env, descend, run

pytestmark = pytest.mark.slow
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


def _commands() -> list[str]:
    doc = (EXAMPLE.read_text().split('"""')[1])
    lines = [line.split("#")[0].strip() for line in doc.splitlines()]
    starts = ("python ", "burncoll launch --nodes", "torchrun ", "mpirun ", "srun ")
    return [line for line in lines if line.startswith(starts)]


def _program(name: str) -> str | None:
    if name == "python":
        return sys.executable
    sibling = Path(sys.executable).with_name(name)  # console scripts of this environment
    return str(sibling) if sibling.exists() else shutil.which(name)


def test_the_docstring_lists_every_launcher() -> None:
    programs = {shlex.split(c)[0] for c in _commands()}
    assert programs == {"python", "burncoll", "torchrun", "mpirun", "srun"}


@pytest.mark.parametrize("command", _commands())
def test_each_documented_command_runs(command: str) -> None:
    argv = shlex.split(command)
    found = _program(argv[0])
    if found is None:
        pytest.skip(f"{argv[0]} is not installed on this machine")
    argv = [found, *(sys.executable if a == "python" else a for a in argv[1:])]
    # as root, Open MPI wants consent; these two variables give it without changing the line
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    OMP_NUM_THREADS="1")
    proc = run(argv, env, timeout=150)
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    # every node reports the final loss of single-process float64 descent (40 steps)
    nodes = 1 if argv[0] == sys.executable else 2
    expected = f"final loss {descend(40)[1][-1]:.6f}, replicas identical: yes"
    for rank in range(nodes):
        assert f"node {rank} of {nodes}: {expected}" in proc.stdout, proc.stdout


def test_the_sbatch_script_is_valid_bash_and_runs_the_example() -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    srun = [line for line in SBATCH.read_text().splitlines() if line.startswith("srun ")]
    assert srun == ["srun python examples/train_anywhere.py --devices 1 --steps 40"]
