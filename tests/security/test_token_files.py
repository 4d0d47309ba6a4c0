"""Token files and the token floor (issue 33, item 4), run as a user runs them: a FIFO given as
the token file hung ``burncoll launch`` (a blocking open); now it, a device and a directory
are refused at once, naming the file. A token under 16 bytes, which one sniffed handshake
gave away offline in 0.4 s, was accepted with a warning; now every entry point refuses it,
saying how to make a strong one. An honest token file still carries an exact all-reduce."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli_security import NODE, clean_env, records
from tests.security.local_attacks import MAX_GROWTH_MIB, REPO, in_child

MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def _launch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``burncoll launch --nodes 2`` of the all-reduce node; a hang is killed at 60 s."""
    return subprocess.run([sys.executable, "-m", "burncoll.cli", "launch", "--nodes", "2",
                           *args, str(NODE)], capture_output=True, text=True, timeout=60,
                          env=env, cwd=REPO, check=False)


def _special(tmp_path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(tmp_path / "token")
        return tmp_path / "token"
    if kind == "directory":
        (tmp_path / "token").mkdir()
        return tmp_path / "token"
    return Path("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("given", ["--auth-token-file", "BURNCOLL_AUTH_TOKEN_FILE"])
def test_launch_refuses_a_special_token_file_at_once(tmp_path: Path, kind: str,
                                                     given: str) -> None:
    path = _special(tmp_path, kind)
    args, env = ((given, str(path)), clean_env()) if given.startswith("--") else (
        (), clean_env(BURNCOLL_AUTH_TOKEN_FILE=str(path)))
    done = _launch(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"auth_token_file={str(path)!r} is not a regular file" in done.stderr, done.stderr
    assert not records(done.stdout)


def test_a_config_refuses_a_fifo_token_file_without_blocking(tmp_path: Path) -> None:
    path = _special(tmp_path, "fifo")
    got = in_child("import burncoll", "burncoll.CollectiveConfig()",
                   {"BURNCOLL_AUTH_TOKEN_FILE": str(path)})
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    assert "is not a regular file" in got["error"][1] and got["growth_mib"] <= MAX_GROWTH_MIB


@pytest.mark.parametrize("how", ["BURNCOLL_AUTH_TOKEN", "--auth-token-file"])
def test_launch_refuses_a_short_token_saying_how_to_make_one(tmp_path: Path, how: str) -> None:
    path = tmp_path / "token"
    path.write_text("abcd\n")
    path.chmod(0o600)
    args, env = ((how, str(path)), clean_env()) if how.startswith("--") else (
        (), clean_env(BURNCOLL_AUTH_TOKEN="abcd"))
    done = _launch(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    what = "auth_token" if how == "BURNCOLL_AUTH_TOKEN" else (
        f"the token in auth_token_file={str(path)!r}")  # which file to fix
    assert f"{what} is only 4 bytes" in done.stderr and "at least 16" in done.stderr
    assert MAKE_ONE in done.stderr and "abcd" not in done.stderr, done.stderr
    assert not records(done.stdout)


@pytest.mark.parametrize("call", [
    "burncoll.CollectiveConfig(auth_token='x' * 15)",
    "burncoll.start_orchestrator(auth_token='abc')",
    "burncoll.orchestration.launch.launch_host(['true'], 1, 0, '127.0.0.1', 1, 1, "
    "auth_token='abc')",
])
def test_every_entry_point_refuses_a_short_token(call: str) -> None:
    got = in_child("import burncoll, burncoll.orchestration.launch", call)
    assert got["error"] is not None and got["error"][0] == "ConfigError", got
    assert "bytes: anyone who sniffs one handshake" in got["error"][1] and MAKE_ONE in got[
        "error"][1]


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_an_honest_token_file_carries_an_exact_all_reduce(tmp_path: Path, mode: int) -> None:
    """A file others may read works with a warning that says how to fix it (before, it came
    as Python's UserWarning line naming burncoll/cli.py and quoting its code)."""
    path, token = tmp_path / "token", secrets.token_hex(16)  # 32 characters
    path.write_text(token + "\n")
    path.chmod(mode)
    done = _launch("--auth-token-file", str(path),
                   env=clean_env(TEST_EXPECT_TOKEN_FILE=str(path), TEST_TIMEOUT="30"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warned = (f"burncoll: warning: auth_token_file={str(path)!r} may be read by other users "
              f"(mode 644); restrict it: chmod 600 {path}\n")
    assert (warned in done.stderr) == (mode == 0o644), done.stderr
    assert "UserWarning" not in done.stderr and "cli.py" not in done.stderr, done.stderr
    found = records(done.stdout)
    assert len(found) == 2 and all(r["ok"] for r in found), found
    assert {r["token_bytes"] for r in found} == {len(token)}
