"""A process with the wrong token: refused quickly and clearly; the running collective is not
disturbed (issue 4). Real member processes and a real orchestrator on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from tests import forked

from .cluster import WORKER, Cluster, child_env

#: The intruder's timeout.
TIMEOUT = 10.0
#: A refused registration is reported before half the intruder's timeout: it did not wait for
#: its deadline (room for a loaded machine).
QUICK = TIMEOUT / 2

pytestmark = pytest.mark.parametrize("transport", ["websocket", "quic"])


def test_a_wrong_token_is_refused_quickly_and_the_collective_runs_on(transport: str) -> None:
    with Cluster(transport) as cluster:
        ports = cluster.ports()
        intruder = forked.start(
            WORKER,
            "intruder",
            cluster.orchestrator.address,
            transport,
            "an intruder's token",
            str(ports[0]),
            stdout=forked.PIPE,
            stderr=forked.PIPE,
            env=child_env(TIMEOUT),
        )
        stdout, stderr = intruder.communicate(timeout=60)
        tries = {r["target"]: r for r in map(json.loads, stdout.splitlines())}
        done = cluster.finish()
        node_log = cluster.node_logs(0)
        orchestrator_log = "\n".join(cluster.orchestrator_log.lines)

    assert set(tries) == {"orchestrator", "data"}, stdout + stderr[-3000:]
    # register() with the wrong token, and a connection to a member's data port.
    for target, attempt in tries.items():
        assert attempt["error"] == "AuthenticationError", attempt
        assert attempt["elapsed"] < QUICK, attempt
        assert "wrong auth token" in attempt["message"], attempt
        assert "same BURNCOLL_AUTH_TOKEN" in attempt["message"], attempt
        assert target == "data" or cluster.orchestrator.address in attempt["message"], attempt
    # Both listeners logged whom they refused and why.
    assert "orchestrator: refused a connection" in orchestrator_log, orchestrator_log
    assert "presented a wrong auth token" in orchestrator_log, orchestrator_log
    assert "data service: refused a connection" in node_log, node_log
    assert "presented a wrong auth token" in node_log, node_log
    # The members' all-reduces were right before, during and after, and none failed.
    assert [r["ok"] for r in done] == [True, True], done
    assert done[0]["iterations"] == done[1]["iterations"] > 0, done
