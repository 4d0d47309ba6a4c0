"""DistributedDataParallel on burncoll's torch.distributed backend: a small regression MLP.

Run it as 2 processes on this host with torchrun (installed with torch)::

    torchrun --nproc-per-node 2 examples/torch_ddp.py

and the same training on torch's Gloo backend, for comparison::

    torchrun --nproc-per-node 2 examples/torch_ddp.py --backend gloo

``burncoll launch`` sets torchrun's variables too (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so this runs the same 2 processes::

    burncoll launch --nodes 2 examples/torch_ddp.py

``import burncoll.torch`` registers the backend; ``init_process_group("burncoll")`` reads
torchrun's variables (env://) as it does for Gloo. Each rank trains on its own batches; DDP
averages the gradients through burncoll, so every replica stays bitwise identical, which
rank 0 checks at the end.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import burncoll.torch  # noqa: F401  (registers the "burncoll" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="burncoll", help="burncoll or gloo")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1 + rank)  # this rank's own batches
    target = torch.linspace(-1, 1, 32)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    digests: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if rank == 0:
        same = len(set(digests)) == 1
        print(f"backend {dist.get_backend()}, {len(digests)} ranks, replicas identical: "
              f"{'yes' if same else 'no'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
