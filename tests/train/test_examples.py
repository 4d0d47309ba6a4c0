"""The examples run as scripts (each in its own process, as a user runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_numpy_example() -> None:
    done = run_example("ddp_numpy.py", "--steps", "60")
    assert done.returncode == 0, done.stderr
    assert "replicas identical: yes" in done.stdout and "final loss:" in done.stdout


def test_numpy_example_reads_the_config_from_the_environment() -> None:
    env_devices = {"BURNCOLL_NUM_DEVICES": "2"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")} | env_devices
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "ddp_numpy.py"), "--steps", "5", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "replicas identical: yes" in done.stdout


def test_jax_example() -> None:
    pytest.importorskip("jax")
    done = run_example("ddp_jax.py", "--steps", "10")
    assert done.returncode == 0, done.stderr
    assert "replicas identical: yes" in done.stdout and "4 JAX devices" in done.stdout


def test_demo_module_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "burncoll.train.demo", "--steps", "50", "--devices", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "2 replicas" in done.stdout and "replicas identical: yes" in done.stdout
