"""One rank of tests/torch/test_ddp.py: a small model trained with DistributedDataParallel
on backend "burncoll" and, in the same processes, on Gloo (a ``new_group(backend="gloo")``),
from the same seeds. Prints JSON lines: a digest of the burncoll replica's parameters (the
test compares them across ranks), and whether the first step's gradients equal a
single-process reference on every rank's batch, and the trained parameters Gloo's.

Usage: ddp_worker.py RANK SIZE (init: env://, the parent sets MASTER_ADDR / MASTER_PORT)
"""

import datetime
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import burncoll.torch  # noqa: F401  (registers "burncoll")

RANK, SIZE = int(sys.argv[1]), int(sys.argv[2])
STEPS = 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)


def loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def reference_grads() -> list[torch.Tensor]:
    """The first step's gradients of one process on every rank's batch (equal batch sizes:
    the mean of the ranks' mean losses is the mean loss of them all)."""
    net = model()
    xs, ys = zip(*(batch(r, 0) for r in range(SIZE)), strict=True)
    loss(net, torch.cat(xs), torch.cat(ys)).backward()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def train(group: Any, hook: Callable[..., Any] | None = None
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(first step's gradients, parameters after STEPS steps) of DDP over ``group``."""
    ddp = DDP(model(), process_group=group, bucket_cap_mb=0.001)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    first: list[torch.Tensor] = []
    for step in range(STEPS):
        opt.zero_grad()
        loss(ddp, *batch(RANK, step)).backward()
        if step == 0:
            first = [p.grad.clone() for p in ddp.parameters() if p.grad is not None]
        opt.step()
    return first, [p.detach().clone() for p in ddp.parameters()]


def bf16_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook, called through this function: DDP refuses to register it
    by name without CUDA and NCCL (its own check, whatever the backend), though it runs."""
    return default_hooks.bf16_compress_hook(group, bucket)  # (annotations evaluated: torch
    # compares the bucket annotation with dist.GradBucket, so no __future__ import here)


def close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=tol, atol=tol)
                                    for x, y in zip(a, b, strict=True))


def digest(params: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()


def main() -> None:
    assert "MASTER_ADDR" in os.environ  # env:// as torchrun would set it
    dist.init_process_group("burncoll", rank=RANK, world_size=SIZE,
                            timeout=datetime.timedelta(seconds=30))
    gloo = dist.new_group(backend="gloo")
    reference = reference_grads()
    grads, params = train(dist.group.WORLD)
    gloo_grads, gloo_params = train(gloo)
    record = {"digest": digest(params), "grads_vs_reference": close(grads, reference, 1e-5),
              "gloo_grads_vs_reference": close(gloo_grads, reference, 1e-5),
              "params_vs_gloo": close(params, gloo_params, 1e-5)}
    for name, hook in (("fp16_compress_hook", default_hooks.fp16_compress_hook),
                       ("bf16_compress_hook", bf16_hook)):
        hooked, hooked_params = train(dist.group.WORLD, hook)
        record[name] = close(hooked, reference, 2e-2)
        record[f"{name} digest"] = digest(hooked_params)
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
