"""``burncoll launch`` across hosts (torchrun's vocabulary) and its restarts, run as a user runs it.

Real launcher processes (``python -m burncoll.cli launch``), real node processes and real
sockets on 127.0.0.1: a node SIGKILLed mid-run is restarted (``--max-restarts``) and the
all-reduces of the new round match NumPy; without restarts the launch fails without hanging;
two launchers of the multi-host form (``--nnodes 2 --node-rank 0/1``) started separately make
one run, and restart together when one of their nodes dies; command lines that cannot work,
and a non-loopback master without a token, are refused before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest

from burncoll import ConfigError
from burncoll.orchestration.launch import launch_host

WORKER = Path(__file__).with_name("restart_worker.py")
REPO = Path(__file__).resolve().parents[2]
#: Seconds any one launcher may take.
RUN_SECONDS = 240
#: The worker's all-reduces (as restart_worker.py: STEPS steps of SIZE elements).
STEPS, SIZE = 2, 64
RESTART_LINE = re.compile(r"burncoll launch: node \d exited with -?\d+.*; restart 1 of 1")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without BURNCOLL_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env.update(PYTHONPATH=str(REPO), BURNCOLL_TIMEOUT="30", **extra)
    return env


def data(peer: int, step: int) -> np.ndarray:
    """What restart_worker.py's peer ``peer`` contributes at ``step`` (same formula)."""
    return np.arange(SIZE, dtype=np.float64) * (peer + 1) + 1000.0 * step + peer


def expected(world: int) -> list[np.ndarray]:
    """The all-reduce of every step over ``world`` peers, in float64."""
    return [np.sum(np.stack([data(p, s) for p in range(world)]), axis=0) for s in range(STEPS)]


def records(stdout: str) -> list[dict[str, object]]:
    """The JSON lines of the nodes' output (after their ``[node R] `` prefix)."""
    found = []
    for line in stdout.splitlines():
        match = re.match(r"\[node (\d+)\] (\{.*\})$", line)
        if match:
            record = json.loads(match.group(2))
            assert record["node"] == int(match.group(1)), line
            found.append(record)
    return found


def check_results(found: list[dict[str, object]], nodes: int, devices: int,
                  restart: int) -> None:
    """One record per peer, from round ``restart``, each step equal to NumPy's."""
    world = nodes * devices
    assert sorted(int(str(r["peer"])) for r in found) == list(range(world)), found
    reference = expected(world)
    for record in found:
        assert record["restart"] == restart, record
        results = record["results"]
        assert isinstance(results, list) and len(results) == STEPS, record
        for step, got in enumerate(results):
            np.testing.assert_array_equal(np.asarray(got, dtype=np.float64), reference[step])


def launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "burncoll.cli", "launch", *args]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def started(argvs: list[list[str]], env: dict[str, str]) -> Iterator[list[subprocess.Popen[str]]]:
    """Launcher processes, each in its own process group; every group is killed on exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for argv in argvs:
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, start_new_session=True))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers left behind, if any
            proc.communicate(timeout=30)


def run_launchers(argvs: list[list[str]], env: dict[str, str]) -> list[tuple[int, str, str]]:
    """Run the launchers together; each one's exit code, stdout and stderr."""
    with started(argvs, env) as procs:
        outputs = [p.communicate(timeout=RUN_SECONDS) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def show(code: int, out: str, err: str) -> str:
    return f"exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"


def test_one_host_restarts_after_a_node_is_killed() -> None:
    [(code, out, err)] = run_launchers(
        [launch_argv("--nodes", "2", "--devices", "2", "--max-restarts", "1", str(WORKER))],
        clean_env(RESTART_TEST_CRASH="node:1"))
    assert code == 0, show(code, out, err)
    assert RESTART_LINE.search(err), show(code, out, err)
    check_results(records(out), nodes=2, devices=2, restart=1)


def test_one_host_without_restarts_fails_without_hanging() -> None:
    [(code, out, err)] = run_launchers(
        [launch_argv("--nodes", "2", "--max-restarts", "0", str(WORKER))],
        clean_env(RESTART_TEST_CRASH="node:1"))
    assert code != 0, show(code, out, err)
    assert "restart 1" not in err, show(code, out, err)
    assert records(out) == [], show(code, out, err)


def host_argvs(port: int, *extra: str) -> list[list[str]]:
    """The two launchers of a 2-host run on 127.0.0.1:``port``, one per node rank."""
    return [launch_argv("--nnodes", "2", "--node-rank", str(rank), "--master-addr",
                        "127.0.0.1", "--master-port", str(port), "--devices", "2", *extra,
                        str(WORKER))
            for rank in (1, 0)]  # the node before its master: it must wait for it


def test_two_launchers_of_the_multi_host_form_make_one_run() -> None:
    results = run_launchers(host_argvs(free_port()), clean_env())
    for rank, (code, out, err) in zip((1, 0), results, strict=True):
        assert code == 0, show(code, out, err)
        assert {r["node"] for r in records(out)} == {rank}, show(code, out, err)
    check_results([r for _, out, _ in results for r in records(out)], 2, 2, restart=0)


def test_two_launchers_restart_together_when_a_node_is_killed() -> None:
    """Node 1 dies; its launcher restarts it, node 0 sees PeerLost, exits, and is restarted
    by its own launcher; the new session runs through. With a token shared by both hosts."""
    env = clean_env(RESTART_TEST_CRASH="node:1", BURNCOLL_AUTH_TOKEN=secrets.token_urlsafe(32))
    results = run_launchers(host_argvs(free_port(), "--max-restarts", "1"), env)
    for code, out, err in results:
        assert code == 0, show(code, out, err)
        assert RESTART_LINE.search(err), show(code, out, err)
    check_results([r for _, out, _ in results for r in records(out)], 2, 2, restart=1)


@pytest.mark.parametrize("args, hint", [
    (["--nnodes", "2", "--node-rank", "0", "--master-port", "29400"], "--master-addr"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29400"], "--node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port",
      "29400"], "--node-rank 2 must be below --nnodes 2"),
    (["--nodes", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
      "--master-port", "29400"], "not allowed with argument"),
    (["--nodes", "2", "--master-addr", "127.0.0.1"], "--nnodes"),
    (["--nodes", "2", "--max-restarts", "-1"], "--max-restarts"),
    (["--nodes", "2", "--nproc-per-node", "3"], "give one of them"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--standalone", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
      "--master-port", "29400"], "--standalone runs every node on this machine"),
])
def test_command_lines_that_cannot_work_are_usage_errors(args: list[str], hint: str) -> None:
    done = subprocess.run(launch_argv(*args, str(WORKER)), capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert done.returncode == 2, show(done.returncode, done.stdout, done.stderr)
    assert "usage:" in done.stderr and hint in done.stderr, done.stderr
    assert "[node" not in done.stdout


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_public_master_without_a_token_is_refused_before_anything_starts(rank: str) -> None:
    """192.0.2.1 (TEST-NET-1): not loopback. Rank 0 would bind it, rank 1 dial it; both stop at
    the missing token first, saying how to give one."""
    done = subprocess.run(
        launch_argv("--nnodes", "2", "--node-rank", rank, "--master-addr", "192.0.2.1",
                    "--master-port", "29400", str(WORKER)),
        capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 2, show(done.returncode, done.stdout, done.stderr)
    for hint in ("192.0.2.1", "BURNCOLL_AUTH_TOKEN=", "--auth-token-file",
                 "BURNCOLL_AUTH_TOKEN_FILE", "every host"):
        assert hint in done.stderr, (hint, done.stderr)
    assert "[node" not in done.stdout


def test_launch_host_refuses_arguments_that_cannot_work() -> None:
    command = [sys.executable, str(WORKER)]
    with pytest.raises(ConfigError, match="node_rank=2"):
        launch_host(command, 2, 2, "127.0.0.1", 29400, 1)
    with pytest.raises(ConfigError, match="master_port=0"):
        launch_host(command, 2, 1, "127.0.0.1", 0, 1)
    with pytest.raises(ConfigError, match="max_restarts=-1"):
        launch_host(command, 2, 1, "127.0.0.1", 29400, 1, max_restarts=-1)
    with pytest.raises(ConfigError, match="BURNCOLL_AUTH_TOKEN"):
        launch_host(command, 2, 1, "192.0.2.1", 29400, 1)
