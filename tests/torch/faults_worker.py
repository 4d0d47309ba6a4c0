"""One rank of tests/torch/test_faults.py. Every rank joins through ``init_method=tcp://``
(rank 0 binds torch's TCPStore) with a short timeout and runs one all_reduce; then
``exit``: the last rank exits, the others all_reduce again with ``async_op=True`` and wait;
``stall``: the last rank sleeps past the timeout, the others all_reduce again (blocking).
Prints what the others got (error type, message, seconds) as one JSON line.

Usage: faults_worker.py RANK SIZE PORT TIMEOUT SCENARIO
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import burncoll.torch  # noqa: F401  (registers "burncoll")

RANK, SIZE, PORT, TIMEOUT, SCENARIO = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                       float(sys.argv[4]), sys.argv[5])


def main() -> None:
    dist.init_process_group("burncoll", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                            world_size=SIZE, timeout=datetime.timedelta(seconds=TIMEOUT))
    x = torch.ones(1000)
    dist.all_reduce(x)
    assert x[0].item() == SIZE
    if RANK == SIZE - 1:
        if SCENARIO == "exit":
            os._exit(3)
        time.sleep(TIMEOUT + 1)  # alive (its connections open) while the others time out
        os._exit(3)
    start = time.monotonic()
    try:
        if SCENARIO == "exit":  # the error reaches Work.wait() (the operation's future)
            dist.all_reduce(x, async_op=True).wait()
        else:  # raised by the blocking call itself
            dist.all_reduce(x)
        record = {"error": None}
    except Exception as exc:
        record = {"error": type(exc).__name__, "message": str(exc),
                  "dist_error": isinstance(exc, dist.DistError)}
    record["seconds"] = time.monotonic() - start
    print(json.dumps(record), flush=True)
    os._exit(0)  # the session failed: nothing to finish


if __name__ == "__main__":
    main()
