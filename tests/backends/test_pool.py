"""Fresh result arrays from the pool: memory comes back only once no array or view holds it.

Arrays and views are kept alive in every way a caller might (a slice, a reshape, a view of
another dtype, a NumPy scalar's base, a memoryview), and every array handed out meanwhile must
share no memory with them; once all are gone the next array of that size reuses the mapping.
A real collective's fresh results stay correct while the pool recycles them.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import burncoll
from burncoll.backends import pool
from tests.harness import run_peers

F32 = np.dtype(np.float32)
COUNT = pool.MIN_BYTES // 4 * 3  # 3 MiB of float32


def _drain() -> None:
    gc.collect()


@pytest.fixture(autouse=True)
def _empty_pool() -> None:
    """Each test starts with empty free lists (earlier tests' results went back to them)."""
    _drain()
    pool.trim()


def test_released_memory_is_reused_and_held_memory_never() -> None:
    _drain()
    first = pool.fresh(COUNT, F32)
    first[:] = 7
    holders = [first[5:9], first.reshape(3, -1), first.view(np.uint8)[100:],
               memoryview(first)]
    del first
    _drain()
    for _ in range(len(holders)):
        other = pool.fresh(COUNT, F32)
        other[:] = -1
        assert not any(np.shares_memory(other, np.asarray(h)) for h in holders)
        del other
    base = np.asarray(holders[0])
    assert (base == 7).all()  # nothing wrote into what a caller still holds
    before = pool.free_bytes()
    del holders, base
    _drain()
    after = pool.free_bytes()
    assert after >= before + COUNT * 4  # every mapping came back
    again = pool.fresh(COUNT, F32)
    assert again.flags.writeable and again.size == COUNT and again.dtype == F32
    assert pool.free_bytes() == after - COUNT * 4  # taken from the free list, not new


def test_small_arrays_come_from_numpy_and_the_free_lists_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = pool.fresh(10, F32)
    assert small.base is None and small.size == 10
    monkeypatch.setattr(pool, "MAX_FREE_BYTES", pool.free_bytes() + COUNT * 4 + 8192)
    arrays = [pool.fresh(COUNT, F32) for _ in range(3)]
    del arrays
    _drain()
    assert pool.free_bytes() <= pool.MAX_FREE_BYTES


def test_many_threads_never_share_an_array() -> None:
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(30):
            a = pool.fresh(COUNT // 3, F32)
            a[:] = seed * 1000 + i
            if not (a == seed * 1000 + i).all():
                errors.append(f"thread {seed} saw another's write")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_fresh_all_reduce_results_stay_correct_while_recycled() -> None:
    n = COUNT

    def work(comm: burncoll.Communicator, i: int) -> list[float]:
        held = []
        sums = []
        for step in range(6):
            x = np.full(n, float(step + comm.rank), np.float32)
            result = comm.all_reduce(x)
            if step % 2:
                held.append(result)  # kept: must never be handed out again
            sums.append(float(result[0]))
            assert (result == result[0]).all()
        for step, kept in zip(range(1, 6, 2), held, strict=True):
            assert (kept == 2 * step + 1).all()
        return sums

    for got in run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=20), work):
        assert got == [2.0 * s + 1 for s in range(6)], got


def test_a_forked_child_writes_its_own_copy() -> None:
    """Pooled memory is private, as malloc'd memory is: a child's writes stay in the child."""
    import os

    array = pool.fresh(COUNT, F32)
    array[:] = 1
    pid = os.fork()
    if pid == 0:  # the child: write, and leave without running the parent's cleanups
        array[:] = 42
        os._exit(0)
    os.waitpid(pid, 0)
    assert (array == 1).all()
