"""The CLI takes the token from a file or the environment, never argv; run as a user runs it.

Real ``burncoll`` processes on 127.0.0.1: ``--auth-token VALUE`` is refused with the reason,
``--auth-token-file`` carries the token to the orchestrator and every node (whose all-reduce
is checked against NumPy), ``burncoll launch`` without a token makes a fresh one, and the
orchestrator refuses a non-loopback ``--host`` without a token.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from burncoll.orchestration.launch import node_environment

NODE = Path(__file__).with_name("allreduce_node.py")
REPO = Path(__file__).resolve().parents[2]
ARGV_REFUSAL = "--auth-token would be visible to every user in /proc/PID/cmdline"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without BURNCOLL_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


#: What ``burncoll launch`` tells each node (nothing else of this process's BURNCOLL_* leaks).
LAUNCH_SETTINGS = {f"BURNCOLL_{k}" for k in ("NODE_RANK", "NUM_NODES", "NUM_DEVICES",
                   "GLOBAL_ADDRESS", "NODE_ADDRESS", "DATA_SERVICE_PORT", "TRANSPORT")}


def node_env(rank: int, nodes: int, address: str, **extra: str) -> dict[str, str]:
    """A node's environment as ``burncoll launch`` makes it, from :func:`clean_env`."""
    settings = {k: v for k, v in node_environment(rank, nodes, 1, address, "websocket").items()
                if k in LAUNCH_SETTINGS}
    return {**clean_env(**extra), **settings}


def burncoll_cli(*args: str, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "burncoll.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or clean_env())


def token_file(tmp_path: Path) -> tuple[Path, str]:
    token = secrets.token_urlsafe(32)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path, token


def records(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line[line.index("{"):]) for line in stdout.splitlines() if "{" in line]


@pytest.mark.parametrize("command", [["orchestrator"], ["launch", str(NODE)]])
def test_a_token_in_argv_is_refused_with_the_reason(command: list[str]) -> None:
    done = burncoll_cli(command[0], "--auth-token", "s3cret-s3cret-s3cret", *command[1:],
                        timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ARGV_REFUSAL in done.stderr and "--auth-token-file" in done.stderr, done.stderr
    assert "BURNCOLL_AUTH_TOKEN" in done.stderr, done.stderr


def test_the_orchestrator_refuses_a_public_host_without_a_token() -> None:
    done = burncoll_cli("orchestrator", "--host", "0.0.0.0", "--port", "0", timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    for hint in ("0.0.0.0", "BURNCOLL_AUTH_TOKEN", "BURNCOLL_AUTH_TOKEN_FILE", "--insecure"):
        assert hint in done.stderr, (hint, done.stderr)
    assert "listening" not in done.stdout


def test_launch_with_a_token_file_runs_an_exact_all_reduce(tmp_path: Path) -> None:
    path, token = token_file(tmp_path)
    env = clean_env(TEST_EXPECT_TOKEN_FILE=str(path), TEST_TIMEOUT="30")
    done = burncoll_cli("launch", "--nodes", "2", "--devices", "2", "--auth-token-file",
                        str(path), str(NODE), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = records(done.stdout)
    assert sorted(int(str(r["peer"])) for r in found) == [0, 1, 2, 3], done.stdout
    assert all(r["ok"] for r in found), found
    assert {r["token_bytes"] for r in found} == {len(token)}, found
    assert token not in done.stdout + done.stderr


def test_launch_without_a_token_makes_a_fresh_strong_one() -> None:
    runs = []
    for _ in range(2):
        done = burncoll_cli("launch", "--nodes", "2", str(NODE),
                            env=clean_env(TEST_TIMEOUT="30"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        found = records(done.stdout)
        assert len(found) == 2 and all(r["ok"] for r in found), found
        assert {r["token_bytes"] for r in found} == {43}, found  # token_urlsafe(32)
        runs.append({r["token_sha"] for r in found})
    assert all(len(shas) == 1 for shas in runs) and runs[0] != runs[1], runs


def test_the_orchestrator_command_reads_its_token_file(tmp_path: Path) -> None:
    """``burncoll orchestrator --auth-token-file``, and two nodes given the same file through
    BURNCOLL_AUTH_TOKEN_FILE: the session forms and the all-reduce is exact; ``--nodes 2``
    refuses a node that says num_nodes=3 at once."""
    path, _ = token_file(tmp_path)
    orch = subprocess.Popen(
        [sys.executable, "-m", "burncoll.cli", "orchestrator", "--port", "0", "--nodes", "2",
         "--auth-token-file", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert orch.stdout is not None
        line = orch.stdout.readline()
        match = re.search(r"listening on (\S+) \(websocket, token authentication\)", line)
        assert match, line + (orch.stderr.read() if orch.poll() is not None and orch.stderr
                              else "")
        address = match.group(1)
        base = {"BURNCOLL_AUTH_TOKEN_FILE": str(path), "TEST_TIMEOUT": "30"}
        wrong = subprocess.run(
            [sys.executable, str(NODE)], capture_output=True, text=True, timeout=60,
            env=node_env(0, 3, address, **base))
        assert "refused this node" in wrong.stdout and "--nodes 2" in wrong.stdout, wrong.stdout
        nodes = [subprocess.Popen([sys.executable, str(NODE)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=node_env(r, 2, address, **base))
                 for r in range(2)]
        outputs = [p.communicate(timeout=90) for p in nodes]
        found = [r for out, _ in outputs for r in records(out)]
        assert len(found) == 2 and all(r["ok"] for r in found), outputs
    finally:
        orch.terminate()
        orch.wait(10)
