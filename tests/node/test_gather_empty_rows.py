"""An all-gather across nodes counts the rows of arrays whose rows hold no elements (a zero
in the trailing shape): ``all_gather(np.zeros((3, 0)))`` on 2 nodes is ``(6, 0)``. The rows
travel in the frames' headers, since such arrays have no bytes to count."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import burncoll

NDArray = np.ndarray[Any, Any]


def _inputs(rank: int) -> list[NDArray]:
    return [np.zeros((3, 0)), np.zeros((rank + 1, 0, 2), np.float32), np.zeros((0,)),
            np.arange(rank + 2, dtype=np.float64) * (rank + 1)]


def _run(address: str, nodes: int, devices: int, transport: str, strategy: str
         ) -> dict[int, list[NDArray] | BaseException]:
    out: dict[int, list[NDArray] | BaseException] = {}

    def peer(node: int, device: int, cfg: burncoll.CollectiveConfig) -> None:
        rank = node * devices + device
        try:
            comm = burncoll.register(rank, device, cfg)
            out[rank] = [comm.all_gather(x) for x in _inputs(rank)]
            comm.finish()
        except burncoll.CollectiveError as exc:
            out[rank] = exc

    threads = []
    for node in range(nodes):
        cfg = burncoll.CollectiveConfig(
            num_nodes=nodes, node_rank=node, num_devices=devices, global_address=address,
            transport=transport, timeout=20, global_all_reduce_strategy=strategy)
        threads += [threading.Thread(target=peer, args=(node, d, cfg)) for d in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize(("transport", "strategy", "nodes", "devices"), [
    ("websocket", "ring", 2, 1), ("tcp", "tree", 3, 2), ("quic", "centralized", 2, 2),
])
def test_rows_without_elements_are_counted_on_every_node(
    transport: str, strategy: str, nodes: int, devices: int
) -> None:
    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        results = _run(orch.address, nodes, devices, transport, strategy)
    world = nodes * devices
    expected = [np.concatenate([_inputs(r)[i] for r in range(world)]) for i in range(4)]
    assert sorted(results) == list(range(world))
    for rank, got in results.items():
        assert not isinstance(got, BaseException), (rank, got)
        for g, want in zip(got, expected, strict=True):
            assert g.shape == want.shape and g.dtype == want.dtype, (rank, g.shape, want.shape)
            assert np.array_equal(g, want)
