"""One rank of tests/torch/test_collectives.py: every torch.distributed operation through the
"burncoll" backend, checked against NumPy float64 references computed from every rank's
inputs (which each rank can make: they are seeded by rank), as PyTorch's Gloo process-group
tests check theirs. Prints one JSON line per case; exits 1 at the first wrong result.

Usage: collectives_worker.py RANK SIZE INIT_METHOD
"""

from __future__ import annotations

import datetime
import json
import sys

import numpy as np
import torch
import torch.distributed as dist

import burncoll
import burncoll.torch  # (registers "burncoll")

RANK, SIZE, INIT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
R = range(SIZE)


def data(rank: int, n: int = 6, kind: str = "float") -> torch.Tensor:
    """Rank ``rank``'s input: floats in [0.5, 1.5) (products stay tame), or ints < 256."""
    rng = np.random.default_rng(1000 + rank)
    if kind == "int":
        return torch.from_numpy(rng.integers(0, 256, n).astype(np.int64))
    return torch.from_numpy((rng.random(n) + 0.5).astype(np.float32))


def f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype != torch.bfloat16 else \
        t.float().numpy().astype(np.float64)


def check(case: str, got: torch.Tensor, want: np.ndarray, tol: float = 1e-5) -> None:
    ok = got.shape == torch.Size(want.shape) and np.allclose(f64(got), want, rtol=tol,
                                                               atol=tol)
    print(json.dumps({"case": case, "ok": bool(ok)}), flush=True)
    if not ok:
        print(f"{case}: got {got} want {want}", file=sys.stderr)
        sys.exit(1)


REFERENCE = {
    "SUM": lambda xs: xs.sum(0), "AVG": lambda xs: xs.mean(0),
    "PRODUCT": lambda xs: xs.prod(0), "MIN": lambda xs: xs.min(0), "MAX": lambda xs: xs.max(0),
    "BAND": lambda xs: np.bitwise_and.reduce(xs.astype(np.int64), 0),
    "BOR": lambda xs: np.bitwise_or.reduce(xs.astype(np.int64), 0),
    "BXOR": lambda xs: np.bitwise_xor.reduce(xs.astype(np.int64), 0),
}
BITWISE = ("BAND", "BOR", "BXOR")


def all_of(kind: str = "float", n: int = 6) -> np.ndarray:
    return np.stack([f64(data(r, n, kind)) for r in R])


def reductions() -> None:
    for op, ref in REFERENCE.items():
        kind = "int" if op in BITWISE else "float"
        x = data(RANK, kind=kind)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        check(f"all_reduce {op}", x, ref(all_of(kind)))
    x = data(RANK)
    work = dist.all_reduce(x, async_op=True)
    check("all_reduce async future", work.get_future().wait()[0], all_of().sum(0))
    x = data(RANK).to(torch.bfloat16)
    dist.all_reduce(x)
    check("all_reduce bfloat16", x, np.stack([f64(data(r).to(torch.bfloat16)) for r in R])
          .sum(0), tol=2e-2)
    for root in R:
        x = data(RANK)
        dist.reduce(x, dst=root, op=dist.ReduceOp.MAX)
        if root == RANK:
            check(f"reduce max root {root}", x, all_of().max(0))


def moves() -> None:
    for root in R:
        x = data(RANK)
        dist.broadcast(x, src=root)
        check(f"broadcast root {root}", x, f64(data(root)))
    outs = [torch.zeros(6) for _ in R]
    dist.all_gather(outs, data(RANK))
    for r in R:
        check(f"all_gather from {r}", outs[r], f64(data(r)))
    flat = torch.zeros(6 * SIZE)
    dist.all_gather_into_tensor(flat, data(RANK))
    check("all_gather_into_tensor", flat, all_of().reshape(-1))
    stacked = torch.zeros(SIZE, 6)
    dist.all_gather_into_tensor(stacked, data(RANK))
    check("all_gather_into_tensor stacked", stacked, all_of())
    root = SIZE - 1
    got = [torch.zeros(6) for _ in R] if root == RANK else None
    dist.gather(data(RANK), got, dst=root)
    if got is not None:
        check("gather", torch.stack(got), all_of())
    out = torch.zeros(6)
    dist.scatter(out, [data(r) * 3 for r in R] if root == RANK else None, src=root)
    check("scatter", out, f64(data(RANK) * 3))


def scatters() -> None:
    sums = all_of(n=6 * SIZE).sum(0).reshape(SIZE, 6)
    out = torch.zeros(6)
    dist.reduce_scatter(out, list(data(RANK, 6 * SIZE).chunk(SIZE)))
    check("reduce_scatter", out, sums[RANK])
    out = torch.zeros(6)
    dist.reduce_scatter_tensor(out, data(RANK, 6 * SIZE), op=dist.ReduceOp.SUM)
    check("reduce_scatter_tensor", out, sums[RANK])
    outs = [torch.zeros(3) for _ in R]
    dist.all_to_all(outs, list(data(RANK, 3 * SIZE).chunk(SIZE)))
    for r in R:
        check(f"all_to_all from {r}", outs[r], f64(data(r, 3 * SIZE))[3 * RANK:3 * RANK + 3])
    out = torch.zeros(2 * SIZE, 3)
    dist.all_to_all_single(out, data(RANK, 6 * SIZE).reshape(2 * SIZE, 3))
    want = [f64(data(r, 6 * SIZE)).reshape(2 * SIZE, 3)[2 * RANK:2 * RANK + 2] for r in R]
    check("all_to_all_single", out, np.concatenate(want))
    # uneven: rank r sends r + d + 1 rows to rank d
    sends = [RANK + d + 1 for d in R]
    recvs = [s + RANK + 1 for s in R]
    x = torch.arange(sum(sends), dtype=torch.float32) + 100 * RANK
    out = torch.zeros(sum(recvs))
    dist.all_to_all_single(out, x, output_split_sizes=recvs, input_split_sizes=sends)
    want_rows = [100 * s + np.arange(sum(s + d + 1 for d in range(RANK)),
                                     sum(s + d + 1 for d in range(RANK + 1))) for s in R]
    check("all_to_all_single split sizes", out, np.concatenate(want_rows).astype(np.float64))


def point_to_point() -> None:
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.zeros(6)
    works = [dist.isend(data(RANK), right), dist.irecv(got, left)]
    for w in works:
        w.wait()
    check("isend/irecv ring", got, f64(data(left)))
    got = torch.zeros(6)
    ops = [dist.P2POp(dist.isend, data(RANK) + 1, right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check("batch_isend_irecv ring", got, f64(data(left) + 1))
    if RANK == 0:
        dist.send(data(0) * 2, 1, tag=7)
    elif RANK == 1:
        got = torch.zeros(6)
        dist.recv(got, 0, tag=7)
        check("send/recv tag 7", got, f64(data(0) * 2))
    dist.barrier()


def groups() -> None:
    members = [r for r in R if r % 2 == 0]
    group = dist.new_group(members)
    if RANK in members:
        x = data(RANK)
        dist.all_reduce(x, group=group)
        check("new_group even ranks", x, all_of()[members].sum(0))
        x = data(RANK)
        dist.broadcast(x, group_src=len(members) - 1, group=group)
        check("new_group broadcast", x, f64(data(members[-1])))
    mine, _ = dist.new_subgroups(group_size=2)
    x = data(RANK)
    dist.all_reduce(x, group=mine)
    pair = [RANK - RANK % 2, RANK - RANK % 2 + 1]
    check("new_subgroups of 2", x, all_of()[pair].sum(0))


def objects() -> None:
    got: list[object] = [None] * SIZE
    dist.all_gather_object(got, {"rank": RANK, "name": f"r{RANK}"})
    ok = got == [{"rank": r, "name": f"r{r}"} for r in R]
    objs: list[object] = [f"from 0: {[1, 2]}"] if RANK == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    ok = ok and objs == ["from 0: [1, 2]"]
    gathered = [None] * SIZE if RANK == 0 else None
    dist.gather_object(("t", RANK), gathered, dst=0)
    ok = ok and (RANK != 0 or gathered == [("t", r) for r in R])
    out: list[object] = [None]
    dist.scatter_object_list(out, [r * 10 for r in R] if RANK == 0 else None, src=0)
    ok = ok and out == [RANK * 10]
    print(json.dumps({"case": "objects", "ok": bool(ok)}), flush=True)
    if not ok:
        sys.exit(1)


def unsupported() -> None:
    """Refused at once, on this rank, naming the operation; the session goes on."""
    for case, call in (
        ("premul_sum", lambda: dist.all_reduce(torch.ones(2),
                                               op=dist._make_nccl_premul_sum(2.0))),
        ("recv_anysource", lambda: dist.recv(torch.ones(2))),
        ("sparse", lambda: dist.all_reduce(torch.ones(3).to_sparse())),
    ):
        try:
            call()
            message = ""
        except burncoll.UsageError as exc:
            message = str(exc)
        print(json.dumps({"case": f"unsupported {case}", "message": message}), flush=True)
    x = data(RANK)
    dist.all_reduce(x)
    check("all_reduce after refusals", x, all_of().sum(0))


def main() -> None:
    dist.init_process_group("burncoll", init_method=INIT, rank=RANK, world_size=SIZE,
                            timeout=datetime.timedelta(seconds=30))
    print(json.dumps({"case": "backend", "name": dist.get_backend()}), flush=True)
    for part in (reductions, moves, scatters, point_to_point, groups, objects, unsupported):
        part()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
