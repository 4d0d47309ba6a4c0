"""The orchestrator's ``min_nodes`` wait belongs to one round of registrations: a round that
filled up leaves no timer behind to cut the next round short (the round after a restart)."""

from __future__ import annotations

import threading
import time

import numpy as np

import burncoll

WAIT = 3.0  # min_nodes_wait
PAUSE = 2.0  # between the rounds: the first round's timer would fire 1 s into the second


def _node(address: str, rank: int, out: dict[int, object]) -> None:
    cfg = burncoll.CollectiveConfig(num_nodes=3, node_rank=rank, global_address=address,
                                    timeout=12)
    try:
        comm = burncoll.register(rank, 0, cfg)
        out[rank] = (comm.world_size, comm.all_reduce(np.full(3, rank + 1.0)).tolist())
        comm.finish()
    except burncoll.CollectiveError as exc:
        out[rank] = exc


def _round(address: str, late: float | None) -> dict[int, object]:
    """Nodes 0 and 1 register now, node 2 after ``late`` seconds (at once when None)."""
    out: dict[int, object] = {}
    threads = [threading.Thread(target=_node, args=(address, r, out)) for r in range(3)]
    for t in threads[:2]:
        t.start()
    if late is not None:
        time.sleep(late)
    threads[2].start()
    for t in threads:
        t.join(30)
    return out


def test_a_full_round_leaves_no_timer_for_the_next() -> None:
    with burncoll.start_orchestrator(expected_nodes=3, min_nodes=2,
                                     min_nodes_wait=WAIT) as orchestrator:
        first = _round(orchestrator.address, None)
        time.sleep(PAUSE)
        # node 2 comes 2 s late: within this round's wait (3 s), after the first round's
        # timer would have fired had it been left armed
        second = _round(orchestrator.address, WAIT - 1.0)
    for results in (first, second):
        assert results == {r: (3, [6.0, 6.0, 6.0]) for r in range(3)}, results
