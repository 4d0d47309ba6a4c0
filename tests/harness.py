"""Run a function on D real peer threads of one node and collect results or errors; or run
a script as N real node processes, each printing one JSON record."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import burncoll
from tests import forked

_REPO = Path(__file__).resolve().parents[1]


def all_reduce_as(comm: burncoll.Communicator, x: np.ndarray, op: str, how: str
                  ) -> np.ndarray:
    """``comm.all_reduce(x, op)`` with the result asked for ``how``: ``"fresh"``, ``"out"``
    (into a new array passed as ``out=``, which the call must return) or ``"in place"``."""
    if how == "out":
        out = np.empty_like(x)
        assert comm.all_reduce(x, op, out=out) is out
        return out
    if how == "in place":
        comm.all_reduce(x, op, out=x)
        return x
    return np.asarray(comm.all_reduce(x, op))


def reduced_float64(xs: np.ndarray, op: str) -> np.ndarray:
    """The reference: ``op`` (sum, mean, max, min, prod) over axis 0 of ``xs`` in float64."""
    xs = xs.astype(np.float64)
    return {"sum": xs.sum(0), "mean": xs.mean(0), "max": xs.max(0), "min": xs.min(0),
            "prod": xs.prod(0)}[op]


def register_node_process(argv: list[str], **config: Any
                          ) -> tuple[burncoll.Communicator, int, int, int]:
    """(In a script that :func:`run_node_processes` runs.) Register the one device of node
    ``NODE`` from ``argv`` = ``NODE NODES ORCH_ADDRESS TRANSPORT DIES`` (20 s timeout, and
    ``config``'s fields); its communicator, ``NODE``, ``NODES`` and ``DIES``."""
    node, nodes, address, transport, dies = int(argv[0]), int(argv[1]), argv[2], argv[3], \
        int(argv[4])
    cfg = burncoll.CollectiveConfig(num_devices=1, num_nodes=nodes, global_address=address,
                                    node_address="127.0.0.1", transport=transport,
                                    timeout=20.0, **config)
    return burncoll.register(node, 0, cfg), node, nodes, dies


def run_node_processes(script: str, nodes: int, transport: str, dies: int = -1
                       ) -> list[dict[str, Any]]:
    """Run ``script NODE NODES ORCH_ADDRESS TRANSPORT DIES`` as ``nodes`` node processes
    (forked, :mod:`tests.forked`) meeting at a real orchestrator; every JSON line they print,
    in node order. Node ``dies`` must exit with status 3 (a process that dies); every other
    one with 0."""
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    with burncoll.start_orchestrator(transport=transport) as orch:
        procs = [forked.start(script, str(n), str(nodes), orch.address, transport, str(dies),
                              stdout=forked.PIPE, stderr=forked.PIPE, env=env)
                 for n in range(nodes)]
        records = []
        for n, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=120)
            if n == dies:
                assert p.returncode == 3, stderr[-2000:]
                continue
            assert p.returncode == 0, stderr[-2000:]
            records.extend(json.loads(line) for line in stdout.splitlines()
                           if line.startswith("{"))
    return records


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
