"""The attacks here target the network between nodes: a relay, corrupted or hostile member
connections. Every node of these tests runs on this one host, where nodes would exchange their
large messages through shared memory (``burncoll.transport.shm``, tested on its own in
``tests/transport/test_shm.py``), out of the attacker's reach; these tests keep them on the
network, as nodes of different hosts are -- all but those marked ``host_memory``, which
attack the shared memory itself (test_hostile_host_memory.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _nodes_talk_over_the_network(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("host_memory") is None:
        monkeypatch.setenv("BURNCOLL_SHARED_MEMORY", "0")  # child processes inherit it
