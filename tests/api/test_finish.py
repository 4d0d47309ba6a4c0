"""``finish()``: a peer left waiting for the other local peers' ``finish`` gives up after
``config.timeout`` (not twice it), naming them; and a process whose peers never called it
warns once per node at exit, as torch.distributed warns when ``destroy_process_group()`` was
not called. Real peer threads, real node processes (a child interpreter per case)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import burncoll
from tests.harness import reduced_float64

_REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 3.0


def test_finish_waits_for_the_other_local_peers_only_the_configured_timeout() -> None:
    config = burncoll.CollectiveConfig(num_devices=2, timeout=TIMEOUT)
    comms: list[burncoll.Communicator | None] = [None, None]

    def peer(i: int) -> None:
        comms[i] = burncoll.register(i, i, config)

    threads = [threading.Thread(target=peer, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    first, second = comms
    assert first is not None and second is not None
    xs = np.arange(6.0).reshape(2, 3)
    got: list[object] = [None, None]
    runs = [threading.Thread(target=lambda i=i, c=c: got.__setitem__(i, c.all_reduce(xs[i])))
            for i, c in enumerate(comms)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(30)
    for result in got:
        np.testing.assert_array_equal(result, reduced_float64(xs, "sum"))
    started = time.monotonic()
    with pytest.raises(burncoll.CollectiveTimeout, match=r"after 3 s: local peer\(s\) \[1\]"):
        first.finish()  # peer 1 never calls it
    # it gave up after the configured timeout: before twice it, its former wait
    assert time.monotonic() - started < 2 * TIMEOUT
    second.finish()


_SCRIPT = """
import sys, threading
import numpy as np, burncoll
with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
    results = [None, None]
    def node(n):
        cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=n, num_devices=1,
                                        global_address=orch.address, timeout=20.0)
        comm = burncoll.register(n, 0, cfg)
        results[n] = comm.all_reduce(np.full(3, n + 1.0)).tolist()
        if sys.argv[1] == "finish":
            comm.finish()
    threads = [threading.Thread(target=node, args=(n,)) for n in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("\\n".join(map(str, results)))  # one write: two threads' prints could interleave
"""


@pytest.mark.parametrize("finish", [True, False])
def test_a_node_whose_peers_never_called_finish_warns_once_at_exit(finish: bool) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, "finish" if finish else "forget"],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=_REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str([3.0] * 3)] * 2  # 1 + 2 on every node
    warned = [line for line in done.stderr.splitlines() if "UserWarning" in line]
    if finish:
        assert warned == [], done.stderr
        return
    assert len(warned) == 2, done.stderr
    for node, line in enumerate(sorted(warned)):
        assert f"peer(s) [{node}] of node {node} of a multi-node collective did not call " \
               "finish()" in line


def _registered(config: burncoll.CollectiveConfig, ids: list[int]) -> list[burncoll.Communicator]:
    comms: dict[int, burncoll.Communicator] = {}
    threads = [threading.Thread(target=lambda i=i, d=d: comms.__setitem__(
        i, burncoll.register(i, d, config)), daemon=True) for d, i in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [comms[i] for i in ids]


@pytest.mark.parametrize("first", ["finish", "all_reduce"])
def test_a_peer_that_finishes_without_an_operation_the_others_wait_in_is_named(
        first: str) -> None:
    """Peer 1 skips the second all-reduce and finishes: peer 0, waiting in it (whichever
    comes first), gets a MismatchError naming peer 1 at once, not a timeout of finish()."""
    config = burncoll.CollectiveConfig(num_devices=2, timeout=30.0)
    comms = _registered(config, [0, 1])
    xs = np.arange(6.0).reshape(2, 3)
    errors: list[BaseException] = []

    def peer(i: int) -> None:
        try:
            np.testing.assert_array_equal(comms[i].all_reduce(xs[i]),
                                          reduced_float64(xs, "sum"))
            if i == 0:
                if first == "finish":
                    time.sleep(0.3)  # (peer 1 finishes first)
                comms[0].all_reduce(xs[0])
            else:
                if first == "all_reduce":
                    time.sleep(0.3)  # (peer 0 waits in all_reduce #1 first)
                comms[1].finish()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=peer, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)  # well before the 30 s timeout: nobody waits for it
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 1 and isinstance(errors[0], burncoll.MismatchError), errors
    assert "all_reduce #1: local peer(s) [1] called finish() after 1 operation(s)" in str(
        errors[0])


_EARLY = """
import threading
import numpy as np, burncoll
with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
    errors = []
    def peer(n, d):
        cfg = burncoll.CollectiveConfig(num_nodes=2, node_rank=n, num_devices=2,
                                        global_address=orch.address, timeout=30.0)
        comm = burncoll.register(2 * n + d, d, cfg)
        try:
            comm.all_reduce(np.ones(3))
            if 2 * n + d != 3:
                comm.all_reduce(np.ones(3))
            comm.finish()
        except burncoll.CollectiveError as exc:
            errors.append(f"{2 * n + d} {type(exc).__name__}: {exc}")
    threads = [threading.Thread(target=peer, args=(n, d)) for n in range(2) for d in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("\\n".join(sorted(errors)))
"""


def test_across_nodes_the_peer_that_finished_early_is_named_on_every_node() -> None:
    """Peer 3 (node 1) skips the second all-reduce and finishes: the peers of both nodes fail
    with the MismatchError that names it, long before their 30 s timeout."""
    done = subprocess.run([sys.executable, "-c", _EARLY], capture_output=True, text=True,
                          timeout=25, cwd=_REPO)
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2"], (done.stdout, done.stderr)
    for line in lines:
        assert "MismatchError: all_reduce #1: local peer(s) [3] called finish()" in line, line
