"""DistributedDataParallel on backend "burncoll", 2 real processes started with torchrun's
variables (env://), as PyTorch's own DDP tests check it: the first step's gradients equal a
single-process reference, every replica is bitwise identical, the trained parameters equal
Gloo's from the same seeds within floating-point tolerance, and the fp16/bf16 compression
communication hooks run on burncoll's Work (tests/torch/ddp_worker.py)."""

from __future__ import annotations

import pytest

from tests.torch.processes import environment, free_port, run_ranks

pytest.importorskip("torch")


def test_ddp_matches_reference_and_gloo() -> None:
    port = str(free_port())
    envs = [environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                        WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
            for r in range(2)]
    results = run_ranks("ddp_worker.py", 2, envs=envs)
    for rank, (status, _, err) in enumerate(results):
        assert status == 0, f"rank {rank}: {err}"
    first, second = (records[0] for _, records, _ in results)
    for record in (first, second):
        assert record["grads_vs_reference"] is True
        assert record["gloo_grads_vs_reference"] is True  # the reference itself is right
        assert record["params_vs_gloo"] is True
        assert record["fp16_compress_hook"] is True
        assert record["bf16_compress_hook"] is True
    for key in ("digest", "fp16_compress_hook digest", "bf16_compress_hook digest"):
        assert first[key] == second[key], key  # replicas bitwise identical
