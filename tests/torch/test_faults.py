"""A rank that exits, or stops calling, surfaces on every other rank as torch's
``DistBackendError`` naming it, within the process group's timeout (tcp:// init;
tests/torch/faults_worker.py)."""

from __future__ import annotations

import pytest

from tests.torch.processes import free_port, run_ranks

pytest.importorskip("torch")

TIMEOUT = 4.0


@pytest.mark.parametrize(("scenario", "size"), [("exit", 3), ("stall", 2)])
def test_failure_reaches_every_rank_naming_who(scenario: str, size: int) -> None:
    results = run_ranks("faults_worker.py", size, str(free_port()), str(TIMEOUT), scenario)
    *others, (last_status, _, _) = results
    assert last_status == 3
    for rank, (status, records, err) in enumerate(others):
        assert status == 0, f"rank {rank}: {err}"
        (record,) = records
        assert record["error"] == "DistBackendError", record
        assert record["dist_error"] is True
        assert f"node {size - 1} (peers [{size - 1}]" in record["message"], record["message"]
        assert record["seconds"] < 2 * TIMEOUT + 5, record
