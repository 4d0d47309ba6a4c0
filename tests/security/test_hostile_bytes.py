"""Strangers sending hostile bytes to a running collective's listeners (issue 4).

Two member processes loop over checked all-reduces around a real orchestrator; meanwhile this
process opens raw connections to node 0's data port and to the orchestrator and sends garbage,
HTTP, burncoll frames without authentication, malformed frames after a proper transport
handshake, oversized and truncated messages, and (QUIC) random datagrams. Each stranger must
be dropped with a logged reason naming it, and the collective must not notice.

The run happens once per transport (cached); the tests below read its outcome.
"""

from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass
from typing import Any

import pytest

from .cluster import Cluster
from .hostile import Attack, Outcome, attacks, silent_stranger

TRANSPORTS = ["websocket", "quic"]


@dataclass(frozen=True)
class HostileRun:
    outcomes: dict[tuple[str, str], Outcome]  # (attack, "node" | "orchestrator") -> outcome
    done: list[dict[str, Any]]
    node_log: str
    orchestrator_log: str


@functools.cache
def hostile_run(transport: str) -> HostileRun:
    with Cluster(transport) as cluster:
        targets = {"node": cluster.ports()[0], "orchestrator": cluster.orchestrator.port}

        async def attack_all() -> dict[tuple[str, str], Outcome]:
            # Silent strangers hold a connection open through the whole run.
            hang_ups = [await silent_stranger(transport, p) for p in targets.values()]
            outcomes = {}
            for attack in attacks(transport):
                for target, port in targets.items():
                    outcomes[attack.name, target] = await attack.run(port)
            for hang_up in hang_ups:
                await hang_up()
            return outcomes

        outcomes = asyncio.run(attack_all())
        done = cluster.finish()
        return HostileRun(
            outcomes, done, cluster.node_logs(0), "\n".join(cluster.orchestrator_log.lines)
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_strangers_never_disturb_the_collective(transport: str) -> None:
    run = hostile_run(transport)
    assert [r["ok"] for r in run.done] == [True, True], run.done
    assert run.done[0]["iterations"] == run.done[1]["iterations"] > 0, run.done
    undropped = {k: o.text for k, o in run.outcomes.items() if not o.dropped}
    assert not undropped, undropped


#: websocket.py on the websockets library drops a failed opening handshake without a WARNING.
_NO_HANDSHAKE_LOG = pytest.mark.xfail(
    reason="websocket.py drops a failed opening handshake without a WARNING that names the "
    "stranger's address",
    strict=False,
)


def _cases() -> list[Any]:
    cases = []
    for transport in TRANSPORTS:
        for attack in attacks(transport):
            if attack.reason is None:
                continue
            for target in ("node", "orchestrator"):
                marks = [] if attack.logs_today else [_NO_HANDSHAKE_LOG]
                name = f"{transport}-{attack.name}-{target}"
                cases.append(pytest.param(transport, attack, target, marks=marks, id=name))
    return cases


@pytest.mark.parametrize(("transport", "attack", "target"), _cases())
def test_each_stranger_is_dropped_with_a_logged_reason(
    transport: str, attack: Attack, target: str
) -> None:
    run = hostile_run(transport)
    outcome = run.outcomes[attack.name, target]
    assert outcome.dropped, outcome.text
    log = run.node_log if target == "node" else run.orchestrator_log
    # The line that names this stranger's address gives the reason.
    lines = [
        line for line in log.splitlines() if re.search(rf"\b127\.0\.0\.1:{outcome.port}\b", line)
    ]
    assert attack.reason is not None
    assert lines, f"nothing logged about 127.0.0.1:{outcome.port}; the log:\n{log}"
    assert any(" WARNING " in line and attack.reason in line for line in lines), lines
