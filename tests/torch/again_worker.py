"""One rank of tests/torch/test_registration.py's second test: the process group is created
on an explicit store (``store=``), used, destroyed and created again on the same store,
whose keys from the first time are still there. Prints the two results as one JSON line.

Usage: again_worker.py RANK SIZE PORT
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

import burncoll.torch  # noqa: F401  (registers "burncoll")

RANK, SIZE, PORT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def main() -> None:
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", PORT, SIZE, RANK == 0, timeout=timeout)
    sums = []
    for round_ in range(2):
        dist.init_process_group("burncoll", store=store, rank=RANK, world_size=SIZE,
                                timeout=timeout)
        x = torch.full((3,), float(RANK + 10 * round_))
        dist.all_reduce(x)
        sums.append(x.tolist())
        dist.destroy_process_group()
    print(json.dumps({"sums": sums}), flush=True)


if __name__ == "__main__":
    main()
