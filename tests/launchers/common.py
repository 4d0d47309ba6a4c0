"""Running the example under launchers: a clean environment and the reference result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_anywhere.py"
CRASHING = Path(__file__).resolve().parent / "crash_train.py"
#: Variables of launchers that must not leak from the test's own environment into children.
LAUNCHER_PREFIXES = ("BURNCOLL_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL",
                     "TORCHELASTIC_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def reference(steps: int) -> dict[str, np.ndarray[Any, Any]]:
    """Full-batch gradient descent with momentum on the example's data, on one process."""
    return descend(steps)[0]


def descend(steps: int) -> tuple[dict[str, np.ndarray[Any, Any]], list[float]]:
    """The example's model trained on one process, in float64: the final parameters and the
    loss of every step (before its update)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_anywhere as ex
    finally:
        sys.path.pop(0)
    x, y = ex.make_data()
    params, opt = ex.init_params(), ex.Momentum()
    velocity = opt.init(params)
    losses = []
    for _ in range(steps):
        loss, grads = ex.loss_and_grad(params, (x, y))
        losses.append(loss)
        updates, velocity = opt.update(grads, velocity)
        params = {k: params[k] + updates[k] for k in params}
    return params, losses


def read_result(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(path.read_text())
    state["params"] = {k: np.asarray(v, dtype=np.float64) for k, v in state["params"].items()}
    return state


def assert_trained(path: Path, steps: int, nodes: int) -> dict[str, Any]:
    """The run wrote its result, on ``nodes`` nodes, equal to the reference within round-off."""
    state = read_result(path)
    assert state["nodes"] == nodes and state["identical"]
    expected = reference(steps)
    for name, value in expected.items():
        np.testing.assert_allclose(state["params"][name], value, rtol=1e-9, atol=1e-12)
    return state


def run(argv: list[str], env: dict[str, str], timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    """Run a command to its end (killed at ``timeout``), its output captured."""
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)
