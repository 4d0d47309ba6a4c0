"""Launcher detection: burncoll launch, torchrun, SLURM, Open MPI and MPICH variables.

Most tests hand :func:`detect_launcher` an explicit environment (a dict); two start real
launchers (``mpirun`` and ``torchrun``) with two processes each and check what each process
detects. SLURM host lists and the derived rendezvous port are checked against tables written
out by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from burncoll.config.launchers import (
    LAUNCHERS,
    MAX_HOSTS,
    LaunchEnvironment,
    derived_port,
    detect_launcher,
    expand_hostlist,
)
from burncoll.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def detect(env: dict[str, str]) -> LaunchEnvironment:
    found = detect_launcher(env)
    assert found is not None, env
    return found


def torchrun_env(**extra: str) -> dict[str, str]:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "abc"}
    env.update(extra)
    return env


def slurm_env(**extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NODEID": "1",
           "SLURM_NNODES": "3",
           "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_ID": "12345",
           "SLURM_JOB_NODELIST": "gpu[07-09]"}
    env.update(extra)
    return env


def ompi_env(**extra: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_ess_base_jobid": "2020737025", "PMIX_NAMESPACE": "2020737025",
           "OMPI_MCA_orte_hnp_uri": "1729888256.0;tcp://192.0.2.2:57723;tcp6://[fd00::2]:36381"}
    env.update(extra)
    return env


def mpich_env(**extra: str) -> dict[str, str]:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4",
           "PMI_KVSNAME": "kvs_4242_0"}
    env.update(extra)
    return env


# -- no launcher, burncoll launch -----------------------------------------------------------


def test_the_detection_order_is_public() -> None:
    assert LAUNCHERS == ("burncoll", "torchrun", "slurm", "openmpi", "mpich")


@pytest.mark.parametrize("env", [{}, {"HOME": "/root"}, {"LOCAL_RANK": "1"},
                                 {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"},
                                 {"RANK": "", "WORLD_SIZE": ""}, {"BURNCOLL_NUM_NODES": "none"}])
def test_no_launcher_gives_none(env: dict[str, str]) -> None:
    assert detect_launcher(env) is None


def test_the_default_environment_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURNCOLL_NUM_NODES", "3")
    monkeypatch.setenv("BURNCOLL_NODE_RANK", "2")
    found = detect_launcher()
    assert found is not None and (found.launcher, found.node_rank, found.num_nodes) == (
        "burncoll", 2, 3)


def test_burncoll_launch() -> None:
    found = detect({"BURNCOLL_NODE_RANK": "1", "BURNCOLL_NUM_NODES": "3",
                    "BURNCOLL_GLOBAL_ADDRESS": "127.0.0.1:29400"})
    assert found == LaunchEnvironment("burncoll", 1, 3, 1, 3, "127.0.0.1:29400", (
        "BURNCOLL_NODE_RANK", "BURNCOLL_NUM_NODES", "BURNCOLL_GLOBAL_ADDRESS"))
    assert found.all_on_one_host


def test_burncoll_without_an_address_or_a_rank() -> None:
    found = detect({"BURNCOLL_NUM_NODES": "2"})
    assert (found.node_rank, found.num_nodes, found.rendezvous) == (0, 2, None)
    found = detect({"BURNCOLL_NODE_RANK": "0"})
    assert (found.node_rank, found.num_nodes, found.local_world_size) == (0, 1, 1)


# -- torchrun --------------------------------------------------------------------------------


def test_torchrun_takes_the_port_after_master_port() -> None:
    found = detect(torchrun_env())
    assert found == LaunchEnvironment("torchrun", 3, 8, 1, 2, "10.0.0.5:29501", (
        "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"))
    assert not found.all_on_one_host


def test_torchrun_on_one_host_and_ipv6() -> None:
    # every process on one host: loopback, whatever MASTER_ADDR (torch's getfqdn()) says
    found = detect(torchrun_env(RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                                MASTER_ADDR="fd00::2"))
    assert found.all_on_one_host and found.rendezvous == "127.0.0.1:29501"
    found = detect(torchrun_env(RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                                MASTER_ADDR="fd00::2"))
    assert not found.all_on_one_host and found.rendezvous == "[fd00::2]:29501"


def test_torchrun_without_local_variables_is_not_one_host() -> None:
    found = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "100"})
    assert (found.local_rank, found.local_world_size, found.all_on_one_host) == (0, 1, False)
    assert found.rendezvous == "h:101"


# -- SLURM -----------------------------------------------------------------------------------


def test_slurm_job_variables() -> None:
    found = detect(slurm_env())
    assert (found.launcher, found.node_rank, found.num_nodes) == ("slurm", 3, 6)
    assert (found.local_rank, found.local_world_size) == (1, 2)
    assert found.rendezvous == f"gpu07:{12345 % 4096 + 61440}"
    assert "SLURM_JOB_NODELIST" in found.variables and not found.all_on_one_host


def test_slurm_step_variables_beat_the_job_ones() -> None:
    found = detect(slurm_env(SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NUM_NODES="2",
                             SLURM_STEP_TASKS_PER_NODE="1,2", SLURM_PROCID="2",
                             SLURM_STEP_NODELIST="cpu[3,1]", SLURM_LOCALID="1"))
    assert (found.node_rank, found.num_nodes, found.local_rank, found.local_world_size) == (
        2, 3, 1, 2)
    assert found.rendezvous is not None and found.rendezvous.startswith("cpu3:")


def test_slurm_master_addr_and_port_win() -> None:
    found = detect(slurm_env(MASTER_ADDR="head", MASTER_PORT="29500"))
    assert found.rendezvous == "head:29501"


def test_slurm_tasks_per_node_lists() -> None:
    for node, tasks in enumerate([2, 2, 2, 1]):
        found = detect(slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="7",
                                 SLURM_NNODES="4", SLURM_NODEID=str(node),
                                 SLURM_TASKS_PER_NODE="2(x3),1"))
        assert found.local_world_size == tasks


def test_slurm_on_one_node() -> None:
    found = detect(slurm_env(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0",
                             SLURM_NNODES="1", SLURM_TASKS_PER_NODE="2"))
    assert found.all_on_one_host


def test_slurm_batch_step_without_ntasks_is_one_process() -> None:
    found = detect({"SLURM_PROCID": "0", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1",
                    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_NODEID": "0"})
    assert (found.node_rank, found.num_nodes, found.local_world_size) == (0, 1, 1)


# -- Open MPI and MPICH ----------------------------------------------------------------------


def test_openmpi_on_one_host_uses_loopback() -> None:
    found = detect(ompi_env())
    port = derived_port("2020737025")
    assert found == LaunchEnvironment("openmpi", 1, 2, 1, 2, f"127.0.0.1:{port}", found.variables)
    assert found.all_on_one_host and "OMPI_MCA_ess_base_jobid" in found.variables


def test_openmpi_across_hosts_uses_mpiruns_host() -> None:
    found = detect(ompi_env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3"))
    assert found.rendezvous == f"192.0.2.2:{2020737025 % 4096 + 61440}"
    several = "9.0;tcp://10.1.1.1,10.2.2.2:5000;tcp6://[fd00::1]:5001"
    found = detect(ompi_env(OMPI_COMM_WORLD_SIZE="4", OMPI_MCA_orte_hnp_uri=several))
    assert found.rendezvous is not None and found.rendezvous.startswith("10.1.1.1:")


def test_openmpi_5_uses_the_pmix_namespace() -> None:
    env = ompi_env(PMIX_NAMESPACE="prterun-host-1234@1")
    del env["OMPI_MCA_ess_base_jobid"], env["OMPI_MCA_orte_hnp_uri"]
    assert detect(env).rendezvous == f"127.0.0.1:{derived_port('prterun-host-1234@1')}"


def test_openmpi_master_variables_win() -> None:
    found = detect(ompi_env(OMPI_COMM_WORLD_SIZE="4", MASTER_ADDR="head", MASTER_PORT="7000"))
    assert found.rendezvous == "head:7001"


def test_mpich_hydra() -> None:
    found = detect(mpich_env())
    assert (found.launcher, found.node_rank, found.num_nodes) == ("mpich", 2, 4)
    assert found.all_on_one_host
    assert found.rendezvous == f"127.0.0.1:{derived_port('kvs_4242_0')}"


def test_mpich_without_local_variables_is_not_one_host() -> None:
    env = mpich_env(MASTER_ADDR="head")
    del env["MPI_LOCALRANKID"], env["MPI_LOCALNRANKS"]
    found = detect(env)
    assert (found.local_rank, found.local_world_size, found.all_on_one_host) == (0, 1, False)
    assert found.rendezvous == f"head:{derived_port('kvs_4242_0')}"


# -- which launcher wins ---------------------------------------------------------------------


@pytest.mark.parametrize(("env", "launcher"), [
    ({**slurm_env(), **torchrun_env()}, "torchrun"),  # torchrun inside a SLURM allocation
    ({**slurm_env(), **torchrun_env(), **ompi_env(), "BURNCOLL_NUM_NODES": "2"}, "burncoll"),
    ({**torchrun_env(), "BURNCOLL_NODE_RANK": "0"}, "burncoll"),
    ({**ompi_env(), **mpich_env()}, "openmpi"),
    ({**slurm_env(), "RANK": "3"}, "slurm"),  # half of torchrun's pair: not torchrun
    # srun direct launch: the MPI ranks agree with SLURM's, SLURM's variables are richer
    ({**slurm_env(), **mpich_env(PMI_RANK="3", PMI_SIZE="6")}, "slurm"),
    # mpirun inside a batch script: the batch step's SLURM_PROCID=0 is inherited
    ({**slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"), **ompi_env()},
     "openmpi"),
    ({**slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"), **mpich_env()},
     "mpich"),
])
def test_detection_order(env: dict[str, str], launcher: str) -> None:
    assert detect(env).launcher == launcher


# -- variables that don't add up -------------------------------------------------------------


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in names}


BAD: list[tuple[str, dict[str, str], tuple[str, ...]]] = [
    ("rank past size", torchrun_env(RANK="8"), ("RANK=8", "WORLD_SIZE=8", "below")),
    ("non-integer rank", torchrun_env(RANK="x"), ("RANK='x'", "not an integer")),
    ("negative rank", torchrun_env(RANK="-1"), ("RANK=-1",)),
    ("empty world", torchrun_env(WORLD_SIZE="0"), ("WORLD_SIZE=0",)),
    ("rank alone", {"RANK": "3"}, ("RANK=3", "WORLD_SIZE")),
    ("world size alone", {"WORLD_SIZE": "3"}, ("WORLD_SIZE=3", "RANK")),
    ("run id alone", {"TORCHELASTIC_RUN_ID": "x"}, ("TORCHELASTIC_RUN_ID", "RANK")),
    ("local rank past local size", torchrun_env(LOCAL_RANK="2"),
     ("LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2")),
    ("local size past world", torchrun_env(LOCAL_WORLD_SIZE="16"),
     ("LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8")),
    ("local rank alone", without(torchrun_env(), "LOCAL_WORLD_SIZE"),
     ("LOCAL_RANK=1", "LOCAL_WORLD_SIZE")),
    ("local size alone", without(torchrun_env(), "LOCAL_RANK"),
     ("LOCAL_WORLD_SIZE=2", "LOCAL_RANK")),
    ("local rank past rank", torchrun_env(RANK="0", LOCAL_RANK="1", GROUP_RANK="0"),
     ("LOCAL_RANK=1", "RANK=0")),
    ("group rank too high", torchrun_env(GROUP_RANK="3"), ("GROUP_RANK=3", "RANK=3")),
    ("no master addr", without(torchrun_env(), "MASTER_ADDR"), ("MASTER_ADDR",)),
    ("no master port", without(torchrun_env(), "MASTER_PORT"), ("MASTER_PORT",)),
    ("last port", torchrun_env(MASTER_PORT="65535"), ("MASTER_PORT=65535",)),
    ("bad port", torchrun_env(MASTER_PORT="http"), ("MASTER_PORT='http'",)),
    ("slurm rank past tasks", slurm_env(SLURM_PROCID="6"),
     ("SLURM_PROCID=6", "SLURM_STEP_NUM_TASKS=6")),
    ("slurm node past nodes", slurm_env(SLURM_NODEID="3"), ("SLURM_NODEID=3", "SLURM_NNODES=3")),
    ("slurm local id past node", slurm_env(SLURM_LOCALID="2"),
     ("SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE")),
    ("slurm bad tasks per node", slurm_env(SLURM_TASKS_PER_NODE="2(x"),
     ("SLURM_TASKS_PER_NODE='2(x'",)),
    ("slurm short tasks per node", slurm_env(SLURM_TASKS_PER_NODE="2"),
     ("SLURM_TASKS_PER_NODE='2'", "SLURM_NODEID=1")),
    ("slurm node over tasks", slurm_env(SLURM_TASKS_PER_NODE="8(x3)"),
     ("SLURM_TASKS_PER_NODE='8(x3)'", "SLURM_STEP_NUM_TASKS=6")),
    ("slurm bad host list", slurm_env(SLURM_JOB_NODELIST="gpu[07-"),
     ("SLURM_JOB_NODELIST='gpu[07-'",)),
    ("slurm no host", without(slurm_env(), "SLURM_JOB_NODELIST"),
     ("MASTER_ADDR", "SLURM_JOB_NODELIST")),
    ("slurm no job id", without(slurm_env(), "SLURM_JOB_ID"), ("SLURM_JOB_ID", "MASTER_PORT")),
    ("slurm batch step rank", without(slurm_env(), "SLURM_STEP_NUM_TASKS"),
     ("SLURM_PROCID=3", "SLURM_STEP_NUM_TASKS")),
    ("slurm local id, no tasks per node", without(slurm_env(), "SLURM_TASKS_PER_NODE"),
     ("SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE")),
    ("ompi rank past size", ompi_env(OMPI_COMM_WORLD_RANK="2"),
     ("OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2")),
    ("ompi size alone", {"OMPI_COMM_WORLD_SIZE": "2"},
     ("OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_RANK")),
    ("ompi no host", without(ompi_env(OMPI_COMM_WORLD_SIZE="4"), "OMPI_MCA_orte_hnp_uri"),
     ("OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_SIZE=2", "MASTER_ADDR")),
    ("ompi no job id", without(ompi_env(), "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
     ("MASTER_PORT", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    ("mpich rank past size", mpich_env(PMI_RANK="4"), ("PMI_RANK=4", "PMI_SIZE=4")),
    ("mpich no host", mpich_env(MPI_LOCALNRANKS="3"), ("PMI_SIZE=4", "MASTER_ADDR")),
    ("mpich no job id", without(mpich_env(), "PMI_KVSNAME"), ("MASTER_PORT", "PMI_KVSNAME")),
    ("mpich local rank alone", without(mpich_env(), "MPI_LOCALNRANKS"),
     ("MPI_LOCALRANKID=2", "MPI_LOCALNRANKS")),
    ("burncoll rank past nodes", {"BURNCOLL_NODE_RANK": "2", "BURNCOLL_NUM_NODES": "2"},
     ("BURNCOLL_NODE_RANK=2", "BURNCOLL_NUM_NODES=2")),
    ("burncoll no nodes", {"BURNCOLL_NUM_NODES": "0"}, ("BURNCOLL_NUM_NODES=0",)),
    ("burncoll rank text", {"BURNCOLL_NODE_RANK": "one"}, ("BURNCOLL_NODE_RANK='one'",)),
]


@pytest.mark.parametrize(("env", "names"), [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_variables_that_do_not_add_up(env: dict[str, str], names: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as caught:
        detect_launcher(env)
    message = str(caught.value)
    assert "variables don't add up" in message
    for name in names:
        assert name in message, (name, message)


def test_a_huge_hostile_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(ConfigError) as caught:
        detect_launcher(torchrun_env(RANK="x" * 1_000_000))
    assert len(str(caught.value)) < 1000


# -- SLURM host lists ------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "hosts"), [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("a[1-2]b,c[3,5]d[9]", ["a1b", "a2b", "c3d9", "c5d9"]),
    ("node", ["node"]),
    (" n1 , n2,n3 ", ["n1", "n2", "n3"]),
    ("login,gpu[8-11],x", ["login", "gpu8", "gpu9", "gpu10", "gpu11", "x"]),
    ("n[001-002]", ["n001", "n002"]),
    ("n[09-10]", ["n09", "n10"]),
    ("n[9-10]", ["n9", "n10"]),
    ("[1-2]", ["1", "2"]),
    ("cpu[3,1]", ["cpu3", "cpu1"]),
    ("", []),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", [
    "n[1-2", "n1-2]", "n[[1]]", "n[1]]", "n[]", "n[2-1]", "n[a-b]", "n[1-]", "n[-1]",
    "n[1-2-3]", "n[1,,2]", "n[x]", "n[1-2],m[", "n[\u0661]",
])
def test_malformed_hostlists(spec: str) -> None:
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(spec)


def test_the_hostlist_cap() -> None:
    hosts = expand_hostlist(f"n[0-{MAX_HOSTS - 1}]")
    assert MAX_HOSTS == 65536 and len(hosts) == MAX_HOSTS and hosts[-1] == "n65535"
    for spec in (f"n[0-{MAX_HOSTS}]", "a[1-256]b[1-257]", "n[0-999999999999999999]",
                 ",".join(["h"] * (MAX_HOSTS + 1)), f"n[0-{MAX_HOSTS - 1}],x"):
        with pytest.raises(ConfigError, match="more than 65536 hosts"):
            expand_hostlist(spec)
    with pytest.raises(ConfigError, match="more than 18 digits"):
        expand_hostlist("n[0-9999999999999999999]")
    with pytest.raises(ConfigError, match="longer than 255 characters"):
        expand_hostlist("n" * 250 + "[1-100000]")


# -- derived ports ---------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "port"), [
    ("12345", 12345 % 4096 + 61440), ("0", 61440), ("4095", 65535), (" 42 ", 61482),
    ("2020737025", 2020737025 % 4096 + 61440),
])
def test_derived_port_of_integer_ids(key: str, port: int) -> None:
    assert derived_port(key) == port


def test_derived_port_of_other_text() -> None:
    assert derived_port("kvs_4242_0") == zlib.crc32(b"kvs_4242_0") % 4096 + 61440
    keys = ["kvs_1_0", "prterun-a@1", "-5", "\u0661", "9" * 5000, "", "x" * 100_000]
    ports = [derived_port(key) for key in keys]
    assert all(61440 <= port <= 65535 for port in ports)
    assert ports == [derived_port(key) for key in keys]


# -- real launchers --------------------------------------------------------------------------

CHILD = """
import dataclasses, json, os
from burncoll.config.launchers import detect_launcher
found = detect_launcher()
with open(os.path.join(os.environ["LAUNCH_REPORTS"], f"{os.getpid()}.json"), "w") as f:
    json.dump({"found": found and dataclasses.asdict(found),
               "master_port": os.environ.get("MASTER_PORT")}, f)
"""

LAUNCHER_PREFIXES = ("BURNCOLL_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_",
                     "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                     "GROUP_RANK")


def run_two(command: list[str]) -> list[dict[str, Any]]:
    """Run a launcher with two processes in a clean environment; what each detected (each
    writes a file of its own: a launcher may interleave the processes' output lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        env["LAUNCH_REPORTS"] = folder
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        reports = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    assert len(reports) == 2, done.stdout + done.stderr
    return sorted(reports, key=lambda report: report["found"]["node_rank"])


def check_two(reports: list[dict[str, Any]], launcher: str) -> None:
    found = [report["found"] for report in reports]
    assert [f["node_rank"] for f in found] == [0, 1]
    assert [f["local_rank"] for f in found] == [0, 1]
    assert all(f["launcher"] == launcher and f["num_nodes"] == 2 for f in found)
    assert all(f["local_world_size"] == 2 for f in found)
    assert found[0]["rendezvous"] == found[1]["rendezvous"] is not None


def test_real_mpirun() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed")
    root = ["--allow-run-as-root", "--oversubscribe"] if os.geteuid() == 0 else []
    reports = run_two([mpirun, *root, "-np", "2", sys.executable, "-c", CHILD])
    check_two(reports, "openmpi")
    assert reports[0]["found"]["rendezvous"].startswith("127.0.0.1:")


def test_real_torchrun() -> None:
    sibling = Path(sys.executable).with_name("torchrun")
    torchrun = str(sibling) if sibling.exists() else shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    reports = run_two([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python",
                       sys.executable, "-c", CHILD])
    check_two(reports, "torchrun")
    host, _, port = reports[0]["found"]["rendezvous"].rpartition(":")
    assert host and int(port) == int(reports[0]["master_port"]) + 1


def test_every_rank_of_an_mpi_job_inside_slurm_agrees() -> None:
    """mpirun / mpiexec in a batch script (SLURM's variables inherited by every rank) and
    srun --mpi=pmi2 (srun started the ranks): each rank picks the same launcher, so they
    all find the same rendezvous."""
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
             "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[01-02]"}
    found = [detect({**batch, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4",
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(r % 2),
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n01",
                     "MASTER_PORT": "29500"}) for r in range(4)]
    assert {f.launcher for f in found} == {"openmpi"}
    assert {f.rendezvous for f in found} == {"n01:29501"}
    assert [f.node_rank for f in found] == [0, 1, 2, 3]
    hydra = [detect({**batch, "PMI_RANK": str(r), "PMI_SIZE": "4", "MASTER_ADDR": "n01",
                     "MASTER_PORT": "29500"}) for r in range(4)]
    assert {f.launcher for f in hydra} == {"mpich"} and [f.node_rank for f in hydra] == [0, 1, 2, 3]
    step = {**batch, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    srun = [detect({**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2),
                    "SLURM_NODEID": str(r // 2), "PMI_RANK": str(r), "PMI_SIZE": "4"})
            for r in range(4)]
    assert {f.launcher for f in srun} == {"slurm"}
    assert len({f.rendezvous for f in srun}) == 1


def test_a_batch_script_without_srun_is_one_process() -> None:
    found = detect({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
                    "SLURM_JOB_NODELIST": "n[01-02]"})
    assert (found.launcher, found.num_nodes, found.node_rank) == ("slurm", 1, 0)
