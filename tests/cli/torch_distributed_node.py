"""A node script for torch.distributed as torchrun runs it: ``init_process_group`` reads RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment (``env://``), rank 0 serves the
store on MASTER_PORT; then one gloo all-reduce of RANK + 1, printed as JSON."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(total)
    print(json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                      "sum": total.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
