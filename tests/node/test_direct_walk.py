"""The direct schedules of gather, scatter, all-to-all, reduce-scatter and scan, walked by every
node of a world
in memory (the simulator of ``test_walk``): each schedule is valid, every block reaches exactly
the nodes that need it with its rows, and frames that break the rules of these operations are
refused naming their sender.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from burncoll.errors import MismatchError, ProtocolError
from burncoll.levels import HostArray
from burncoll.ops import OpKind
from burncoll.protocol.checks import header_check
from burncoll.protocol.wire import DataHeader
from burncoll.strategies._checks import validate_schedule
from burncoll.strategies.direct import (
    all_to_all_schedule,
    first_ranks,
    gather_schedule,
    prefix_schedule,
    reduce_scatter_schedule,
    scatter_schedule,
)
from tests.node.test_walk import _op, describe, simulate

PART = 64  # bytes: blocks travel in several parts


def _owners(nodes: int, ranks: int, seed: int) -> tuple[int, ...]:
    """Ranks spread over ``nodes`` (each node holds at least one), interleaved at random."""
    rng = random.Random(seed)
    owners = [r % nodes for r in range(ranks)]
    rng.shuffle(owners)
    return tuple(owners)


def _block(rank: int, rows: int) -> HostArray:
    return (np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) + 100 * rank)


@pytest.mark.parametrize(("nodes", "ranks", "seed"), [(2, 2, 0), (2, 4, 1), (3, 5, 2),
                                                      (4, 7, 3), (3, 3, 4)])
def test_gather_and_scatter_reach_the_root_and_the_owners(nodes: int, ranks: int,
                                                          seed: int) -> None:
    owners = _owners(nodes, ranks, seed)
    blocks = [_block(r, r % 4) for r in range(ranks)]  # a rank with no rows
    for root in range(nodes):
        schedule = gather_schedule(nodes, owners, root)
        validate_schedule(schedule)
        ops = [_op(OpKind.GATHER, shape=(3,)) for _ in range(nodes)]
        chunks = [[blocks[r] if owners[r] == n else None for r in range(ranks)]
                  for n in range(nodes)]
        walks = simulate(schedule, ops, chunks, PART, seed=seed)
        for r in range(ranks):
            np.testing.assert_array_equal(walks[root].chunks[r], blocks[r])
        schedule = scatter_schedule(nodes, owners, root)
        validate_schedule(schedule)
        ops = [_op(OpKind.SCATTER, shape=(3,)) if n == root else
               _op(OpKind.SCATTER, dtype=None) for n in range(nodes)]
        chunks = [[blocks[r] if n == root else None for r in range(ranks)] for n in range(nodes)]
        walks = simulate(schedule, ops, chunks, PART, seed=seed)
        for r in range(ranks):
            np.testing.assert_array_equal(walks[owners[r]].chunks[r], blocks[r])


@pytest.mark.parametrize(("nodes", "ranks", "seed"), [(2, 3, 0), (3, 4, 1), (4, 6, 2)])
def test_all_to_all_and_prefix_deliver_what_each_node_needs(nodes: int, ranks: int,
                                                            seed: int) -> None:
    owners = _owners(nodes, ranks, seed)
    pair = {(s, d): _block(s * ranks + d, (s + d) % 3) for s in range(ranks)
            for d in range(ranks)}
    schedule = all_to_all_schedule(nodes, owners)
    validate_schedule(schedule)
    ops = [_op(OpKind.ALL_TO_ALL, shape=(3,)) for _ in range(nodes)]
    chunks = [[pair[s, d] if owners[s] == n else None
               for s, d in itertools.product(range(ranks), repeat=2)] for n in range(nodes)]
    walks = simulate(schedule, ops, chunks, PART, seed=seed)
    for s, d in itertools.product(range(ranks), repeat=2):
        np.testing.assert_array_equal(walks[owners[d]].chunks[s * ranks + d], pair[s, d])

    schedule = prefix_schedule(nodes, owners)
    validate_schedule(schedule)
    ops = [_op(OpKind.SCAN, shape=(3,)) for _ in range(nodes)]
    rows = [_block(r, 1) for r in range(ranks)]
    chunks = [[rows[r] if owners[r] == n else None for r in range(ranks)]
              for n in range(nodes)]
    walks = simulate(schedule, ops, chunks, PART, seed=seed)
    for n in range(nodes):
        last = max(r for r in range(ranks) if owners[r] == n)
        for r in range(ranks):
            got = walks[n].chunks[r]
            if r <= last:  # every rank before this node's last one is here, nothing after
                np.testing.assert_array_equal(got, rows[r])
            elif owners[r] != n:
                assert got is None


@pytest.mark.parametrize(("nodes", "ranks", "seed"), [(2, 2, 0), (2, 6, 1), (3, 7, 2),
                                                      (4, 9, 3)])
def test_reduce_scatter_sends_one_block_per_node_and_rank(nodes: int, ranks: int,
                                                          seed: int) -> None:
    """With counts, each node's blocks for a rank are combined before they leave: one block
    to each rank of another node, from each node -- 1 / (ranks held) of all-to-all's."""
    owners = _owners(nodes, ranks, seed)
    first = first_ranks(nodes, owners)
    assert sorted(first) == list(range(nodes))
    assert all(owners[f] == n and f == owners.index(n) for n, f in first.items())
    combined = {(n, d): _block(n * ranks + d, (n + d) % 3) for n in range(nodes)
                for d in range(ranks)}
    schedule = reduce_scatter_schedule(nodes, owners)
    validate_schedule(schedule)
    steps = [step for round_ in schedule.rounds for step in round_]
    for n in range(nodes):
        sent = [s for s in steps if s.src == n]
        remote = [d for d in range(ranks) if owners[d] != n]
        assert sorted(s.chunk for s in sent) == [first[n] * ranks + d for d in remote]
        all_to_all = [s for r in all_to_all_schedule(nodes, owners).rounds for s in r
                      if s.src == n]
        assert len(all_to_all) == owners.count(n) * len(sent)
    ops = [_op(OpKind.REDUCE_SCATTER, shape=(3,)) for _ in range(nodes)]
    # a receiver holds a buffer of the agreed size for each block it expects (as the plan
    # does): no frame is taken for a chunk it did not size itself
    chunks: list[list[HostArray | None]] = [
        [combined[m, d] if first[m] == s else None
         for s, d in itertools.product(range(ranks), repeat=2)] for m in range(nodes)]
    for m, (n, f) in itertools.product(range(nodes), first.items()):
        for d in range(ranks):
            if owners[d] == m and n != m:
                chunks[m][f * ranks + d] = np.empty(combined[n, d].size)
    walks = simulate(schedule, ops, chunks, PART, seed=seed)
    for n, d in itertools.product(range(nodes), range(ranks)):
        got = walks[owners[d]].chunks[first[n] * ranks + d]
        assert got is not None
        np.testing.assert_array_equal(got.reshape(combined[n, d].shape), combined[n, d])


def _header(kind: OpKind, shape: tuple[int, ...], dtype: str = "float64", chunk: int = 0,
            root: int = -1) -> DataHeader:
    return DataHeader(session=3, seq=5, op_kind=kind, reduce_op=None, dtype=dtype, shape=shape,
                      root=root, src=1, round=0, channel=0, chunk=chunk, offset=0,
                      chunk_bytes=8)


def test_frames_that_break_these_operations_are_refused() -> None:
    scan = header_check(_op(OpKind.SCAN, shape=(3,)), 0, describe)
    assert scan(_header(OpKind.SCAN, (1, 3))) is None
    assert isinstance(scan(_header(OpKind.SCAN, (2, 3))), MismatchError)  # a scan row is one
    assert isinstance(scan(_header(OpKind.GATHER, (1, 3))), MismatchError)
    receiver = header_check(_op(OpKind.SCATTER, dtype=None, root=4), 0, describe)
    assert receiver(_header(OpKind.SCATTER, (2, 3), root=4)) is None
    assert isinstance(receiver(_header(OpKind.SCATTER, (2, 3), root=2)), MismatchError)
    error = receiver(_header(OpKind.SCATTER, (2, 4), chunk=1, root=4))
    assert isinstance(error, ProtocolError) and "every block of one scatter" in str(error)
    gather = header_check(_op(OpKind.GATHER, shape=(3,)), 0, describe)
    assert isinstance(gather(_header(OpKind.GATHER, (2, 3), dtype="float32")), MismatchError)
    assert isinstance(gather(_header(OpKind.GATHER, (3,))), MismatchError)  # no rows
