"""The adversarial suite of issue 11: every attack of the issue, made on a live collective.

Each attack runs against a live collective of real processes (an orchestrator process and 2
member nodes looping over all-reduces that they check exactly against a NumPy float64
reference; :mod:`tests.security.victims`), from another loopback address
(:data:`~tests.security.attacks.ATTACKER_HOST`), with real sockets. Each asserts:

(a) the memory growth of the attacked process (its peak ``VmRSS`` during the attack and
    half a second after, over the most in the second before) stays under the bound stated
    below (:data:`BASE` plus so much per connection);
(b) every result of the live collective stays exact (no node ever returns a wrong result);
(c) the legitimate run goes on during the attack and finishes within its timeout -- or, for a
    man in the middle, fails on every node with a :class:`~burncoll.CollectiveError`.

The attacks' sizes are CI sizes; ``python benchmarks/attacks.py`` runs the issue's full sizes.
Attacks on one transport share one live collective (cached per transport): each measured
alone, one after the other. The collectives whose memory no test measures (the newcomer, the
relayed ones, those of the strangers' tests) fork their processes from a preloaded server
(``Settings(fork=True)``, ``tests/forked.py``); the attacked ones start fresh interpreters.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import burncoll
from tests import shared

from . import attacks as a
from .victims import (
    REPO,
    TOKEN,
    KiB,
    LiveCollective,
    Measured,
    MiB,
    Settings,
    free_port,
    measure,
    summarize,
)

# -- the bounds (what "bounded" means, per connection and in total) ----------------------------

#: Allowed growth of any attacked process whatever the attack: allocator slack and the
#: collective's own buffers (it keeps running during the attack).
BASE = 32 * MiB
#: Per connection of a stranger on a stream transport before authentication: the
#: pre-authentication budget (16 KiB) and the connection's bookkeeping, with room.
STREAM_PER_CONNECTION = 128 * KiB
#: Per idle connection (nothing sent).
IDLE_PER_CONNECTION = 64 * KiB
#: Per QUIC connection of a stranger before authentication: aioquic's connection and TLS
#: state and the small pre-authentication flow-control window.
QUIC_PER_CONNECTION = 256 * KiB
#: An Initial flood, in total: handshakes in progress are capped (Retry under load).
INITIAL_FLOOD = 64 * MiB

# -- the CI sizes -------------------------------------------------------------------------------

PIPELINED_CONNECTIONS = 30
#: Payload each pipelining stranger sends after its header (if the listener reads it).
PIPELINED_SEND = 8 * MiB
FRAGMENT_CONNECTIONS = 40
FRAGMENTS = 4095
#: Over the victims' open-file limit (1024), as in the issue.
IDLE_CONNECTIONS = 1100
QUIC_CONNECTIONS = 12
INITIAL_PACKETS = 800
INITIAL_SECONDS = 1.0
#: How long each attack holds what it opened.
HOLD = 0.3
#: The quiet time measured before each attack (the RSS baseline), and after it.
BASELINE_WINDOW = 0.3
SETTLE = 0.2
#: The members' operation timeout.
TIMEOUT = 10.0

TARGETS = ("node", "orchestrator")


def pipelined_bound(connections: int) -> int:
    return BASE + connections * STREAM_PER_CONNECTION


def idle_bound(connections: int) -> int:
    return BASE + connections * IDLE_PER_CONNECTION


def quic_bound(connections: int) -> int:
    return BASE + connections * QUIC_PER_CONNECTION


# -- one live collective per transport, attacked in turn -------------------------------------


@dataclass
class AttackRun:
    measured: dict[tuple[str, str], Measured]
    summary: dict[str, Any]
    done: list[dict[str, Any]]
    #: The second collective that registered with the orchestrator during the idle flood.
    newcomer: dict[str, Any] | None
    logs: str


def _targets(live: LiveCollective) -> dict[str, tuple[int, int]]:
    """Target -> (port, pid) of the process listening there."""
    node0 = live.ready()[0]
    return {"node": (int(node0["port"]), int(node0["pid"])),
            "orchestrator": (live.orchestrator_port, live.orchestrator_pid)}


def _newcomer(transport: str, orchestrator: str) -> dict[str, Any]:
    """A second collective registers with the orchestrator (under attack), runs and finishes."""
    settings = Settings(transport=transport, orchestrator=False, orchestrator_address=orchestrator,
                        peer_base=100, timeout=TIMEOUT, fork=True)
    started = time.monotonic()
    try:
        with LiveCollective(settings) as late:
            late.ready()
            registered = time.monotonic() - started
            late.wait_progress(10, TIMEOUT)
            summary = summarize(late.finish())
            return {**summary, "registered_in": registered}
    except AssertionError as exc:
        return {"ok": False, "wrong": 0, "errors": ["did not register"], "message": str(exc)[:3000]}


def _stream_attacks(transport: str) -> list[str]:
    names = ["pipelined"]
    if transport == "websocket":
        names.append("fragments")
    return [*names, "idle"]


def _run_stream_attack(name: str, transport: str, port: int, target: str,
                       loop: a.BackgroundLoop, during: Any) -> tuple[Any, int]:
    """(attack(alarm) callable, bound) for ``name``."""
    if name == "pipelined":
        return (lambda alarm: loop.run(a.stream_pipelined(
            transport, port, target, PIPELINED_CONNECTIONS, alarm, send_cap=PIPELINED_SEND,
            hold=HOLD)), pipelined_bound(PIPELINED_CONNECTIONS))
    if name == "fragments":
        return (lambda alarm: loop.run(a.ws_fragments(
            port, target, FRAGMENT_CONNECTIONS, alarm, fragments=FRAGMENTS, hold=HOLD)),
            pipelined_bound(FRAGMENT_CONNECTIONS))
    assert name == "idle"
    return (lambda alarm: loop.run(a.idle_flood(
        port, target, IDLE_CONNECTIONS, alarm, during=during, hold=HOLD)),
        idle_bound(IDLE_CONNECTIONS))


@functools.cache
def stream_run(transport: str) -> AttackRun:
    """The attacks on ``transport``'s live collective: run once per session (tests/shared.py)."""
    return shared.once(f"attacks-{transport}", lambda: _stream_run(transport))


def _stream_run(transport: str) -> AttackRun:
    a.raise_nofile()
    measured: dict[tuple[str, str], Measured] = {}
    newcomer: dict[str, Any] | None = None
    settings = Settings(transport=transport, devices=2, timeout=TIMEOUT)
    with LiveCollective(settings) as live, a.BackgroundLoop() as loop:
        targets = _targets(live)
        live.wait_progress(10, TIMEOUT)
        for name in _stream_attacks(transport):
            for target, (port, pid) in targets.items():
                during = None
                if name == "idle" and target == "orchestrator":
                    async def register_meanwhile() -> None:
                        nonlocal newcomer
                        newcomer = await asyncio.to_thread(
                            _newcomer, transport, live.orchestrator_address)
                    during = register_meanwhile
                attack, bound = _run_stream_attack(name, transport, port, target, loop, during)
                measured[name, target] = measure(live, pid, attack, bound, settle=SETTLE,
                                              baseline_window=BASELINE_WINDOW)
        done = live.finish(TIMEOUT * 3)
        return AttackRun(measured, summarize(done), done, newcomer, live.logs())


def _quic_attack(name: str, port: int, target: str, loop: a.BackgroundLoop) -> tuple[Any, int]:
    if name == "length_prefix":
        return (lambda alarm: loop.run(a.quic_length_prefix(
            port, target, QUIC_CONNECTIONS, alarm, hold=HOLD)), quic_bound(QUIC_CONNECTIONS))
    if name == "stream_offset":
        return (lambda alarm: loop.run(a.quic_stream_offset(
            port, target, QUIC_CONNECTIONS, alarm, hold=HOLD)), quic_bound(QUIC_CONNECTIONS))
    assert name == "initial_flood"
    packets = a.initial_packets(port, INITIAL_PACKETS)  # made before the clock starts
    return (lambda alarm: loop.run(a.quic_initial_flood(
        port, target, packets, INITIAL_SECONDS, alarm, hold=HOLD)), BASE + INITIAL_FLOOD)


QUIC_ATTACKS = ("length_prefix", "stream_offset", "initial_flood")


@functools.cache
def quic_run() -> AttackRun:
    """The attacks on QUIC's live collective: run once per session (tests/shared.py)."""
    return shared.once("attacks-quic", _quic_run)


def _quic_run() -> AttackRun:
    measured: dict[tuple[str, str], Measured] = {}
    settings = Settings(transport="quic", devices=1, timeout=TIMEOUT)
    with LiveCollective(settings) as live, a.BackgroundLoop() as loop:
        targets = _targets(live)
        live.wait_progress(10, TIMEOUT)
        for name in QUIC_ATTACKS:
            for target, (port, pid) in targets.items():
                attack, bound = _quic_attack(name, port, target, loop)
                measured[name, target] = measure(live, pid, attack, bound, settle=SETTLE,
                                              baseline_window=BASELINE_WINDOW)
        done = live.finish(TIMEOUT * 3)
        return AttackRun(measured, summarize(done), done, None, live.logs())


def _run_of(transport: str) -> AttackRun:
    return quic_run() if transport == "quic" else stream_run(transport)


PREAUTH_CASES = [
    *((t, n, g) for t in ("tcp", "websocket") for n in _stream_attacks(t) for g in TARGETS),
    *(("quic", n, g) for n in QUIC_ATTACKS for g in TARGETS),
]


@pytest.mark.parametrize(("transport", "attack", "target"), PREAUTH_CASES)
def test_a_stranger_cannot_grow_a_listener_beyond_its_bound(
        transport: str, attack: str, target: str) -> None:
    m = _run_of(transport).measured[attack, target]
    assert not m.report.stopped_by_alarm, m.describe()
    assert m.growth <= m.bound, m.describe()


@pytest.mark.parametrize(("transport", "attack", "target"), PREAUTH_CASES)
def test_the_collective_keeps_working_during_each_attack(
        transport: str, attack: str, target: str) -> None:
    run = _run_of(transport)
    m = run.measured[attack, target]
    assert m.ops_during > 0, m.describe()


@pytest.mark.parametrize("transport", ["tcp", "websocket", "quic"])
def test_every_result_stays_exact_and_the_run_finishes(transport: str) -> None:
    run = _run_of(transport)
    assert run.summary["wrong"] == 0, run.done
    assert run.summary["ok"], (run.done, run.logs[-3000:])
    assert run.summary["slowest"] < TIMEOUT, run.summary


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_new_node_registers_while_strangers_hold_every_connection(transport: str) -> None:
    run = stream_run(transport)
    flood = run.measured["idle", "orchestrator"]
    assert run.newcomer is not None, flood.describe()
    assert run.newcomer["ok"] and run.newcomer["wrong"] == 0, (run.newcomer, flood.describe())


# -- the man in the middle -------------------------------------------------------------------------

#: transport, config: the protected modes. A relay without the token must fail authentication
#: (TLS: the HMAC is bound to the certificate the node presents, not the relay's) or the
#: per-frame tags (integrity).
PROTECTED = [
    pytest.param("quic", {}, id="quic"),
    pytest.param("websocket", {"tls": True}, id="wss-tls"),
    pytest.param("tcp", {"integrity": True}, id="tcp-integrity"),
    pytest.param("websocket", {"integrity": True}, id="ws-integrity"),
]
MITM_TIMEOUT = 5.0


@dataclass
class RelayRun:
    done: list[dict[str, Any]]
    forwarded: int
    flipped: int
    errors: list[str]
    logs: str


def relay_run(transport: str, config: dict[str, Any]) -> RelayRun:
    """Node 0 listens on a port of its own but tells the orchestrator the relay's: node 1
    dials the relay, which dials node 0 (see :class:`~tests.security.attacks.Relay`)."""
    tls = bool(config.get("tls")) or transport == "quic"
    real = free_port(2 if transport == "quic" else 1)  # SOCK_DGRAM / SOCK_STREAM
    with a.BackgroundLoop() as loop:
        relay = a.Relay(transport, tls, real)
        relay_port = loop.run(relay.start())
        settings = Settings(transport=transport, timeout=MITM_TIMEOUT, config=config, fork=True,
                            node_options={0: {"data_port": real, "advertise_port": relay_port}})
        try:
            with LiveCollective(settings) as live:
                deadline = time.monotonic() + MITM_TIMEOUT * 4
                while time.monotonic() < deadline and len(live.of("done")) < 2 and not (
                        relay.flipped >= 5 and live.progress() >= 10):
                    live.wait_progress(live.progress() + 1, 0.2)
                done = live.finish(MITM_TIMEOUT * 4)
                logs = live.logs()
        finally:
            loop.run(relay.close())
    return RelayRun(done, relay.forwarded, relay.flipped, relay.errors, logs)


@pytest.mark.parametrize(("transport", "config"), PROTECTED)
def test_a_relay_without_the_token_fails_every_node_and_alters_no_result(
        transport: str, config: dict[str, Any]) -> None:
    run = relay_run(transport, config)
    described = (run.done, f"relay forwarded {run.forwarded}, flipped {run.flipped}",
                 run.errors, run.logs[-3000:])
    assert all(int(r.get("wrong", 0)) == 0 for r in run.done), described
    assert all(not r.get("ok") and r.get("error") for r in run.done), described
    assert all(r["error"] != "AssertionError" for r in run.done), described


@pytest.mark.xfail(
    strict=True,
    reason="plain tcp/ws without integrity is the documented unprotected mode: a relay that "
    "forwards the challenge-response can then alter array data undetected",
)
@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_plain_tcp_without_integrity_is_not_protected_against_a_relay(transport: str) -> None:
    run = relay_run(transport, {})
    assert run.flipped > 0, (run.done, run.errors)  # the relay did alter data
    assert all(int(r.get("wrong", 0)) == 0 for r in run.done), run.done


# -- no token --------------------------------------------------------------------------------------


def test_a_stranger_registering_first_with_another_num_nodes_blocks_nobody() -> None:
    with LiveCollective(Settings(token=None, members=False, fork=True)) as orch, (
            a.BackgroundLoop()) as loop:
        fingerprint = burncoll.CollectiveConfig(
            num_nodes=2, global_address=orch.orchestrator_address, node_address="127.0.0.1",
        ).global_fingerprint()
        stranger = loop.run(a.register_first("websocket", orch.orchestrator_port, 99, [0],
                                             fingerprint))
        settings = Settings(token=None, orchestrator=False, timeout=TIMEOUT, fork=True,
                            orchestrator_address=orch.orchestrator_address)
        try:
            with LiveCollective(settings) as live:
                live.ready()
                live.wait_progress(10, TIMEOUT)
                summary = summarize(live.finish())
                logs = live.logs()
        finally:
            loop.run(stranger.close())
    assert summary["ok"] and summary["wrong"] == 0, (summary, logs[-3000:])


def test_a_stranger_saying_hello_as_a_node_gets_no_array() -> None:
    """Two strangers, one saying hello without a session and one with a guessed one, knock on
    node 0's data port from before it listens until the collective has run a while."""
    port = free_port()
    settings = Settings(token=None, timeout=MITM_TIMEOUT, node_options={0: {"data_port": port}},
                        fork=True)
    with a.BackgroundLoop() as loop:
        hellos = [loop.submit(a.hello_as_node("websocket", port, 1, session, listen_for=4.0))
                  for session in (None, 1)]
        with LiveCollective(settings) as live:
            outcomes = [hello.result(30) for hello in hellos]
            live.wait_progress(live.progress() + 10, MITM_TIMEOUT * 2)
            done = live.finish(MITM_TIMEOUT * 4)
    for outcome in outcomes:
        # Without a token, member connections authenticate with the session's secret, which
        # the orchestrator gave the members only: the stranger is refused before its hello.
        assert not outcome.connected and outcome.error, outcome
        assert outcome.data_frames == 0, (outcome, done)
    # the legitimate run: exact, and finished or failed with a CollectiveError
    assert all(int(r.get("wrong", 0)) == 0 for r in done), done
    assert all(r.get("ok") or r.get("error") not in (None, "AssertionError") for r in done), done


# -- token hygiene -------------------------------------------------------------------------------


def _burncoll(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0
              ) -> subprocess.CompletedProcess[str]:
    code = "import sys; from burncoll.cli import main; sys.exit(main())"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def test_the_orchestrator_refuses_a_token_on_the_command_line() -> None:
    try:
        result = _burncoll("orchestrator", "--port", "0", "--auth-token", TOKEN, timeout=10.0)
    except subprocess.TimeoutExpired:
        pytest.fail("`burncoll orchestrator --auth-token ...` started (it ran for 10 s)")
    assert result.returncode != 0, result
    assert "--auth-token-file" in result.stderr, result.stderr


_SHOW_CMDLINES = """
import json, os
def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")
print("CMDLINES " + json.dumps([cmdline(os.getpid()), cmdline(os.getppid())]), flush=True)
"""


def test_the_token_is_not_on_any_command_line_of_launch() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN)
        script = Path(tmp) / "show.py"
        script.write_text(_SHOW_CMDLINES)
        result = _burncoll("launch", "--nodes", "2", "--devices", "1", "--auth-token-file",
                           str(token_file), str(script))
    assert result.returncode == 0, (result.stdout, result.stderr)
    lines = [line.split("CMDLINES ", 1)[1] for line in result.stdout.splitlines()
             if "CMDLINES " in line]
    assert len(lines) == 2, result.stdout
    for line in lines:
        for cmdline in json.loads(line):  # the node's own, and the launcher's
            assert TOKEN not in cmdline, cmdline


def test_repr_and_str_of_a_config_hide_the_token() -> None:
    config = burncoll.CollectiveConfig(auth_token=TOKEN)
    assert TOKEN not in repr(config) and TOKEN not in str(config), repr(config)


# A guard of this module's own harness: the attacks reach the victims from another address.
def test_the_attacker_address_is_usable() -> None:
    import socket

    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.bind((a.ATTACKER_HOST, 0))
        client.connect(server.getsockname())
        peer, address = server.accept()
        peer.close()
    assert address[0] == a.ATTACKER_HOST


