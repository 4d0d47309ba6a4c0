"""Hostile launcher variables (issue 33, item 3): a job's environment is often assembled by
other tools, so every length and number read from it is bounded before work that grows with
it. Each case runs in a fresh interpreter: a ``ConfigError`` naming the variable, a message
of bounded length, memory growth within 100 MiB (the issue measured 0.5-8.5 GB), no hang.
Honest values still work."""

from __future__ import annotations

from typing import Any

import pytest

from burncoll.config.launchers import derived_port
from tests.security.local_attacks import MAX_GROWTH_MIB, in_child

#: A SLURM srun step of 2 tasks on 2 nodes; each case changes or adds variables.
SLURM = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
         "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[01-04],gpu7"}
LONG = "a" * 16_000
DIGITS = "9" * 4_000


def _detect(env: dict[str, str]) -> dict[str, Any]:
    return in_child("from burncoll.config.launchers import detect_launcher",
                    "detect_launcher().rendezvous", env)


def test_an_honest_slurm_step_finds_its_first_host() -> None:
    got = _detect(SLURM)
    assert got["error"] is None and got["value"] == repr(f"node01:{derived_port('4242')}")


@pytest.mark.parametrize(("changes", "variable", "why"), [
    # a 16 KB literal was copied into each of 65,536 names: 1,049 MiB, though one is used
    ({"SLURM_STEP_NODELIST": LONG + "[1-65536]"}, "SLURM_STEP_NODELIST", "longer than 255"),
    ({"SLURM_STEP_NODELIST": f"n[{'0' * 4000}1-65536]"}, "SLURM_STEP_NODELIST",
     "more than 18 digits"),
    ({"SLURM_STEP_TASKS_PER_NODE": f"1(x{'9' * 5000})"}, "SLURM_STEP_TASKS_PER_NODE",
     "at most 18 digits"),  # was a bare ValueError
    ({"SLURM_NODEID": DIGITS}, "SLURM_NODEID", "at most 18 digits"),
    ({"SLURM_STEP_NUM_TASKS": DIGITS}, "SLURM_STEP_NUM_TASKS", "at most 18 digits"),
    ({"MASTER_ADDR": LONG}, "MASTER_ADDR", "longer than 255"),
])
def test_a_hostile_slurm_variable_is_refused_within_bounds(
        changes: dict[str, str], variable: str, why: str) -> None:
    got = _detect({**SLURM, **changes})
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    message = got["error"][1]
    assert f"{variable}=" in message and why in message, message
    assert len(message) < 1000, len(message)
    assert got["growth_mib"] <= MAX_GROWTH_MIB, got


def test_only_the_host_used_is_made_of_a_huge_host_list() -> None:
    """A valid list of 65,536 hosts behind the first: the first is used, nothing else made."""
    got = _detect({**SLURM, "SLURM_STEP_NODELIST": "head," + "x" * 200 + "[1-65536]"})
    assert got["error"] is None and got["value"].startswith("'head:"), got
    assert got["growth_mib"] <= MAX_GROWTH_MIB, got


@pytest.mark.parametrize(("env", "variable"), [
    ({"RANK": DIGITS, "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "9" * 5000}, "OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": DIGITS},
     "MPI_LOCALNRANKS"),
    ({"BURNCOLL_NUM_NODES": DIGITS}, "BURNCOLL_NUM_NODES"),
])
def test_other_launchers_numbers_are_bounded(env: dict[str, str], variable: str) -> None:
    got = _detect(env)
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    assert f"{variable}=" in got["error"][1] and "at most 18 digits" in got["error"][1]
    assert len(got["error"][1]) < 1000 and got["growth_mib"] <= MAX_GROWTH_MIB


@pytest.mark.parametrize(("value", "why"), [
    ("1000000000", "BURNCOLL_NUM_DEVICES=1000000000: expected 1 to 1024"),
    (DIGITS, "at most 18 digits"), ("0", "expected 1 to 1024"),
])
def test_a_huge_device_count_fails_at_once_naming_the_variable(value: str, why: str) -> None:
    """``BURNCOLL_NUM_DEVICES=1000000000`` made ``register`` allocate until MemoryError after
    28 s, naming nothing."""
    got = in_child("import burncoll",
                   "burncoll.register(0, 0, burncoll.CollectiveConfig(backend='numpy'))",
                   {"BURNCOLL_NUM_DEVICES": value})
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    assert "BURNCOLL_NUM_DEVICES" in got["error"][1] and why in got["error"][1], got
    assert len(got["error"][1]) < 1000 and got["growth_mib"] <= MAX_GROWTH_MIB


def test_a_huge_device_count_in_code_is_refused_too() -> None:
    got = in_child("import burncoll", "burncoll.CollectiveConfig(num_devices=10**9)")
    assert got["error"] == ["ConfigError", "num_devices=1000000000: expected at most 1024 local "
                            "peers (one thread each)"]


@pytest.mark.parametrize("variable", ["BURNCOLL_TRANSPORT", "BURNCOLL_BACKEND",
                                      "BURNCOLL_GLOBAL_ADDRESS", "BURNCOLL_COMPRESSION",
                                      "BURNCOLL_GLOBAL_ALL_REDUCE_STRATEGY", "BURNCOLL_TIMEOUT"])
def test_a_huge_setting_is_quoted_short(variable: str) -> None:
    """Messages quoting a 20 KB value were 20 KB long: now its middle is elided."""
    got = in_child("import burncoll", "burncoll.CollectiveConfig(num_nodes=2)",
                   {variable: "x" * 20_000})
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    assert variable in got["error"][1] and len(got["error"][1]) < 500, got["error"][1]
