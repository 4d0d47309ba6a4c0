"""A node that fails, or is refused, before its collective formed: the nodes already waiting
for it at the orchestrator learn why at once, with its error's class and message naming it,
instead of waiting out their timeout for a bare CollectiveTimeout.

Real orchestrator, real node threads registering with real configs, real sockets on 127.0.0.1.
Node 0 registers first and is waiting at the orchestrator before node 1 fails; node 0's
timeout is 30 s, and it must have failed well within half of it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import burncoll

TIMEOUT = 30.0
TOKEN = "waiting nodes test token, long enough"


class Node:
    """The peer threads of one node, registering with ``config``; each thread's error and
    how long its register took, by its position in ``peer_ids``."""

    def __init__(self, config: burncoll.CollectiveConfig, peer_ids: list[int]) -> None:
        self.errors: dict[int, BaseException | None] = {}
        self.seconds: dict[int, float] = {}
        self.threads = [threading.Thread(target=self._peer, args=(i, p, config), daemon=True)
                        for i, p in enumerate(peer_ids)]
        for thread in self.threads:
            thread.start()

    def _peer(self, device: int, peer_id: int, config: burncoll.CollectiveConfig) -> None:
        started = time.monotonic()
        try:
            burncoll.register(peer_id, device, config).finish()
            self.errors[device] = None
        except BaseException as exc:  # the test looks at it
            self.errors[device] = exc
        self.seconds[device] = time.monotonic() - started

    def join(self) -> None:
        for thread in self.threads:
            thread.join(TIMEOUT + 15)
            assert not thread.is_alive(), "a peer outlived its register timeout"


def config(rank: int, address: str, **fields: Any) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(num_nodes=2, num_devices=2, node_rank=rank,
                                     global_address=address, timeout=TIMEOUT, **fields)


def wait_until_waiting(orch: burncoll.Orchestrator, count: int) -> None:
    """Until ``count`` nodes wait at the orchestrator (node 0 registered)."""
    deadline = time.monotonic() + TIMEOUT
    while orch._room.waiting < count:
        assert time.monotonic() < deadline, "node 0 never reached the orchestrator"
        time.sleep(0.02)


@contextmanager
def node_zero_waiting(orch: burncoll.Orchestrator, **fields: Any) -> Iterator[Node]:
    node = Node(config(0, orch.address, **fields), [0, 1])
    wait_until_waiting(orch, 1)
    yield node
    node.join()


def told(node: Node, kind: type[BaseException], *needles: str) -> None:
    """Every peer of ``node`` failed with ``kind``, the message holding ``needles``, well
    within its timeout."""
    assert len(node.errors) == len(node.threads), node.errors
    for device, error in node.errors.items():
        assert isinstance(error, kind), (device, repr(error))
        for needle in needles:
            assert needle in str(error), (needle, str(error))
        assert node.seconds[device] < TIMEOUT / 2, (device, node.seconds[device], str(error))


def test_a_node_whose_data_service_port_is_in_use_fails_the_waiting_node_at_once() -> None:
    with socket.socket() as busy, burncoll.start_orchestrator() as orch:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with node_zero_waiting(orch) as waiting:
            failing = Node(config(1, orch.address, data_service_port=port), [2, 3])
            failing.join()
    told(failing, burncoll.TransportError, "data service", str(port))
    own = str(failing.errors[0])
    told(waiting, burncoll.TransportError, "node 1 (peer ids [2, 3]", own)


def test_a_peer_id_registered_twice_fails_its_node_and_the_waiting_node_at_once() -> None:
    with (burncoll.start_orchestrator(auth_token=TOKEN) as orch,
          node_zero_waiting(orch, auth_token=TOKEN) as waiting):
        failing = Node(config(1, orch.address, auth_token=TOKEN), [2, 2])
        failing.join()
    told(failing, burncoll.UsageError, "peer id 2 was registered twice on node 1")
    told(waiting, burncoll.UsageError, "node 1 (peer ids [2]",
         "peer id 2 was registered twice on node 1")


def test_with_a_token_a_node_whose_strategy_differs_fails_the_waiting_node_at_once() -> None:
    with (burncoll.start_orchestrator(auth_token=TOKEN) as orch,
          node_zero_waiting(orch, auth_token=TOKEN) as waiting):
        failing = Node(config(1, orch.address, auth_token=TOKEN,
                              global_all_reduce_strategy="tree:2"), [2, 3])
        failing.join()
    told(failing, burncoll.ConfigError, "global_all_reduce_strategy: 'tree:2' here")
    told(waiting, burncoll.ConfigError, "refused the node at", "peer ids [2, 3]",
         "global_all_reduce_strategy: 'auto' here, 'tree:2' on that node")


def test_elastic_nodes_are_only_noticed_and_go_on_without_the_failed_one() -> None:
    """With ``min_nodes`` the others form a smaller session without a node that failed:
    told only, they are not failed (the session forms after the wait)."""
    with socket.socket() as busy, burncoll.start_orchestrator(
            min_nodes=1, min_nodes_wait=3.0) as orch:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with node_zero_waiting(orch) as waiting:
            failing = Node(config(1, orch.address,
                                  data_service_port=busy.getsockname()[1]), [2, 3])
            failing.join()
    assert all(isinstance(e, burncoll.TransportError) for e in failing.errors.values())
    assert waiting.errors == {0: None, 1: None}, waiting.errors
