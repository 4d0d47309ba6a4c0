"""The sample configs (configs/*.yaml) run as shipped on one host: two real node processes
started as the multi-node configs' comments say, each setting only its node rank (and the
orchestrator's address, here a free port rather than the documented 29400)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import burncoll
from tests import forked

REPO = Path(__file__).resolve().parents[2]
NODE = Path(__file__).with_name("shipped_config_node.py")


@pytest.mark.parametrize("name", ["multi-node-websocket.yaml", "multi-node-quic.yaml"])
def test_a_multi_node_config_runs_as_shipped_on_one_host(name: str) -> None:
    path = REPO / "configs" / name
    shipped = burncoll.CollectiveConfig.from_yaml(path)
    assert shipped.data_service_port in (0, None), "two nodes of one host would collide"
    base = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    with burncoll.start_orchestrator(transport=shipped.transport) as orch:
        nodes = [forked.start(NODE, str(path), stdout=forked.PIPE, stderr=forked.PIPE,
                              env=base | {"PYTHONPATH": str(REPO), "BURNCOLL_NODE_RANK": str(r),
                                          "BURNCOLL_GLOBAL_ADDRESS": orch.address})
                 for r in range(shipped.num_nodes or 1)]
        outputs = [node.communicate(timeout=4 * shipped.timeout) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
        assert "Warning" not in stderr, stderr[-3000:]
    results = [json.loads(line) for out, _ in outputs for line in out.splitlines()]
    peers = len(burncoll.peer_ids(shipped)) * (shipped.num_nodes or 1)
    expected = np.arange(5, dtype=np.float64) * sum(p + 1 for p in range(peers))
    assert sorted(r["peer"] for r in results) == list(range(peers))
    for r in results:
        np.testing.assert_allclose(r["sum"], expected)


def test_every_multi_node_config_says_which_line_to_change_for_two_hosts() -> None:
    for path in (REPO / "configs").glob("multi-node-*.yaml"):
        text = path.read_text()
        assert "For two hosts, change the global_address line" in text, path
        line = next(t for t in text.splitlines() if t.startswith("global_address:"))
        assert "127.0.0.1" in line and "# two hosts:" in line, path
