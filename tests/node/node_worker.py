"""One node process for the multi-node tests: runs a scenario on the public API only.

Usage: python node_worker.py SCENARIO NODE_RANK NUM_NODES DEVICES ORCH_ADDRESS LOCAL GLOBAL
TRANSPORT
Prints one JSON line per peer: {"peer": id, "ok": bool, "error": type, "message": str}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import burncoll


def data(pid: int, rows: int = 9) -> np.ndarray:
    return (np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (pid + 1)) % 13 - 6


def every_op(comm: burncoll.Communicator, world: int, rounds: int) -> None:
    pid = comm.peer_id
    ids = comm.peer_ids
    for _ in range(rounds):
        for op, fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min),
                       ("prod", np.prod)):
            ref = fn(np.stack([data(p) for p in ids]), axis=0)
            np.testing.assert_allclose(comm.all_reduce(data(pid), op=op), ref, rtol=1e-12)
        total = np.sum(np.stack([data(p) for p in ids]), axis=0)
        for root in ids:
            r = comm.reduce(data(pid), root=root)
            if pid == root:
                np.testing.assert_allclose(r, total, rtol=1e-12)
            else:
                assert r is None
            mine = data(pid)
            b = comm.broadcast(mine if pid == root else None, root=root)
            np.testing.assert_array_equal(b, data(root))
            b += 1  # results never alias the caller's input
            np.testing.assert_array_equal(mine, data(pid))
        np.testing.assert_allclose(comm.reduce_scatter(data(pid)),
                                   np.array_split(total, world)[comm.rank], rtol=1e-12)
        gathered = comm.all_gather(data(pid, rows=1 + pid % 3))
        np.testing.assert_array_equal(gathered, np.concatenate([data(p, 1 + p % 3) for p in ids]))
        comm.barrier()


def mixed_sizes(comm: burncoll.Communicator, world: int, count: int) -> None:
    rng = np.random.default_rng(1234)  # the same sequence on every peer
    sizes = [1, 7, 1000, 65536, 1 << 20, *list(rng.integers(1, 1 << 20, size=count - 5))]
    for k, size in enumerate(sizes):
        x = np.full(size, comm.peer_id + 1, dtype=np.float32) + (k % 5)
        ref = float(sum(p + 1 + (k % 5) for p in comm.peer_ids))
        r = comm.all_reduce(x)
        if not np.all(x == comm.peer_id + 1 + (k % 5)):
            raise AssertionError(f"operation {k} modified its input")
        if r.shape != (size,) or not np.all(r == ref):
            raise AssertionError(f"operation {k} of {size} elements is wrong")


def run_peer(scenario: str, pid: int, local: int, cfg: burncoll.CollectiveConfig,
             world: int, node: int, out: list[dict[str, object]]) -> None:
    started = time.monotonic()
    record: dict[str, object] = {"peer": pid}
    try:
        comm = burncoll.register(pid, local, cfg)
        if scenario == "every_op":
            every_op(comm, world, rounds=2)
        elif scenario == "sharded":
            link = comm._server.link  # internal: checks which composition runs
            if link is None or not link.sharded:
                raise AssertionError("a local ring on every node should shard")
            every_op(comm, world, rounds=1)
            mixed_sizes(comm, world, count=20)
        elif scenario == "mixed":
            mixed_sizes(comm, world, count=200)
        elif scenario == "mismatch":
            comm.all_reduce(np.ones(4))
            comm.all_reduce(np.ones(5 if node == 1 else 4))
        elif scenario == "kill":
            for k in range(1000):
                if node == 1 and k == 5:
                    os._exit(17)
                comm.all_reduce(np.ones(1000))
        record["ok"] = True
        comm.finish()
    except burncoll.CollectiveError as exc:
        record.update(ok=False, error=type(exc).__name__, message=str(exc))
    except AssertionError as exc:
        record.update(ok=False, error="AssertionError", message=str(exc))
    record["elapsed"] = time.monotonic() - started
    out.append(record)


def main() -> None:
    scenario, node, nodes, devices = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(
        sys.argv[4])
    address, local_s, global_s, transport = sys.argv[5:9]
    if "|" in local_s:  # one local strategy per node: "ring|tree" -> node 0 ring, node 1 tree
        choices = local_s.split("|")
        local_s = choices[node % len(choices)]
    timeout = float(os.environ.get("TEST_TIMEOUT", "20"))
    cfg = burncoll.CollectiveConfig(
        num_devices=devices, num_nodes=nodes, global_address=address,
        node_address="127.0.0.1", data_service_port=0, transport=transport, timeout=timeout,
        local_all_reduce_strategy=local_s, local_reduce_strategy=local_s,
        local_broadcast_strategy=local_s, global_all_reduce_strategy=global_s,
        global_reduce_strategy=global_s, global_broadcast_strategy=global_s,
    )
    out: list[dict[str, object]] = []
    threads = [
        threading.Thread(target=run_peer,
                         args=(scenario, node * devices + i, i, cfg, nodes * devices, node, out))
        for i in range(devices)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for record in out:
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
