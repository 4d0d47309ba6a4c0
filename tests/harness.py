"""Run a function on D real peer threads of one node and collect results or errors."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import burncoll


def run_peers(
    config: burncoll.CollectiveConfig,
    fn: Callable[[burncoll.Communicator, int], Any],
    peer_ids: list[int] | None = None,
    join_timeout: float = 60.0,
) -> list[Any]:
    """Register ``config.num_devices`` peers in threads, run ``fn(comm, i)`` on each, finish.

    Returns each peer's result, or the exception it raised, in local index order.
    """
    d = config.num_devices
    ids = peer_ids if peer_ids is not None else list(range(d))
    out: list[Any] = [None] * d

    def worker(i: int) -> None:
        _one_peer(out, i, lambda: burncoll.register(ids[i], i, config),
                  lambda comm: fn(comm, i))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(d)]
    _start_and_join(threads, join_timeout)
    return out


def run_nodes(
    address: str,
    nodes: int,
    devices: int,
    fn: Callable[[burncoll.Communicator], Any],
    *,
    transport: str = "websocket",
    timeout: float | list[float] = 20.0,
    rank_of: Callable[[int, int], int] | None = None,
    peer_id: Callable[[int], int] | None = None,
    join_timeout: float = 90.0,
    **config: Any,
) -> dict[int, Any]:
    """``fn(comm)`` on ``devices`` peer threads of each of ``nodes`` nodes, all in this
    process, meeting at the orchestrator at ``address``; each peer's result or error, by rank.

    Node ``n``'s config has ``num_nodes``, ``node_rank=n``, ``num_devices``, the transport,
    its timeout (``timeout[n]`` when a list) and ``config``. The peer of device ``d`` of node
    ``n`` has rank ``rank_of(n, d)`` (default ``n * devices + d``) and peer id
    ``peer_id(rank)`` (default the rank). A peer's ``finish()`` error after its own failure
    is dropped: its own error says what happened.
    """
    out: dict[int, Any] = {}
    rank_of = rank_of or (lambda node, device: node * devices + device)
    ident = peer_id or (lambda rank: rank)

    def peer(rank: int, device: int, cfg: burncoll.CollectiveConfig) -> None:
        _one_peer(out, rank, lambda: burncoll.register(ident(rank), device, cfg), fn)

    threads = []
    for node in range(nodes):
        seconds = timeout[node] if isinstance(timeout, list) else timeout
        cfg = burncoll.CollectiveConfig(
            num_nodes=nodes, node_rank=node, num_devices=devices, global_address=address,
            transport=transport, timeout=seconds, **config)
        threads += [threading.Thread(target=peer, args=(rank_of(node, d), d, cfg), daemon=True)
                    for d in range(devices)]
    _start_and_join(threads, join_timeout)
    return out


def _one_peer(out: Any, key: int, register: Callable[[], burncoll.Communicator],
              fn: Callable[[burncoll.Communicator], Any]) -> None:
    """Register, run ``fn``, finish; ``out[key]`` gets the result or the error. A finish
    that fails after the collective did is dropped: the peer's own error says why."""
    try:
        comm = register()
    except BaseException as exc:
        out[key] = exc
        return
    try:
        out[key] = fn(comm)
    except BaseException as exc:
        out[key] = exc
    finally:
        with contextlib.suppress(burncoll.CollectiveError):
            comm.finish()


def _start_and_join(threads: list[threading.Thread], join_timeout: float) -> None:
    """Start every peer thread, wait for each (bounded); fail if one is still running."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a peer thread hung"
