"""``--min-nodes`` and the orchestrator's ``min_nodes``: bad values are refused clearly."""

from __future__ import annotations

import pytest

import burncoll
from burncoll.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "2", "--min-nodes", "1"], "--min-nodes"),
    (["--nnodes", "3", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
      "29400", "--min-nodes", "4"], "--min-nodes 4 must be at most --nnodes 3"),
    (["--nnodes", "3", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
      "29400", "--min-nodes", "2", "--min-nodes-wait", "0"], "--min-nodes-wait 0"),
])
def test_bad_min_nodes_arguments_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["launch", *argv, "script.py"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"expected_nodes": 3, "min_nodes": 4}, "min_nodes=4"),
    ({"min_nodes": 0}, "min_nodes=0"),
    ({"min_nodes": 2, "min_nodes_wait": -1}, "min_nodes_wait=-1"),
])
def test_bad_min_nodes_for_the_orchestrator(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(burncoll.ConfigError, match=message):
        burncoll.start_orchestrator(**kwargs)  # type: ignore[arg-type]
