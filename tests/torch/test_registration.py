"""``import burncoll`` leaves torch alone; ``import burncoll.torch`` registers "burncoll",
and a group of one rank made from an explicit store (``store=``) works without any network
(a real process, so torch's global state stays out of the test process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.torch.processes import REPO, RUN_SECONDS, environment, free_port, run_ranks

pytest.importorskip("torch")

SCRIPT = """
import sys
import burncoll
assert "torch" not in sys.modules, "import burncoll imported torch"
import torch
import torch.distributed as dist
import burncoll.torch
assert "burncoll" in dist.Backend.backend_list
dist.init_process_group("burncoll", store=dist.HashStore(), rank=0, world_size=1)
x = torch.tensor([1.5, -2.0])
dist.all_reduce(x, op=dist.ReduceOp.MAX)
assert x.tolist() == [1.5, -2.0], x
group = dist.new_group([0])
y = torch.zeros(1)
dist.all_gather_into_tensor(y, torch.tensor([7.0, 8.0])[:1], group=group)
assert y.tolist() == [7.0], y
assert dist.get_backend(group) == "burncoll"
dist.destroy_process_group()
print("ok")
"""


def test_import_registers_and_one_rank_runs() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=environment(),
                          text=True, capture_output=True, timeout=RUN_SECONDS, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_a_group_made_again_on_the_same_store() -> None:
    """The second session reads its own rank 0's address, not the first one's (gone)."""
    results = run_ranks("again_worker.py", 2, str(free_port()))
    for rank, (status, records, err) in enumerate(results):
        assert status == 0, f"rank {rank}: {err}"
        assert records == [{"sums": [[1.0] * 3, [21.0] * 3]}]
