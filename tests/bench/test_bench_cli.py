"""``burncoll bench`` run in-process: tables, checking, JSON, errors, peer baselines."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from burncoll.bench.options import ALL_OPS
from burncoll.cli import main

COLUMNS = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
QUICK = ["--iters", "3", "--warmup", "1"]


def _tables(out: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """``{op: (header names, rows as cells)}`` parsed from the bench's output."""
    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#") and i + 1 < len(lines) and lines[i + 1].startswith("#  "):
            names = lines[i + 1][1:].split()
            if names[:2] == ["size", "count"] and names[2:3] == ["type"]:
                header = names[: len(COLUMNS)] + [f"vs {n}" for n in names[len(COLUMNS) + 1 :: 2]]
                rows = []
                for row_line in lines[i + 3 :]:
                    if row_line.startswith("#"):
                        break
                    rows.append(row_line.split())
                tables[line[2:].strip()] = (header, rows)
    return tables


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_op_with_three_devices_is_correct(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys,
        "--op",
        "all",
        "--devices",
        "3",
        "--min-bytes",
        "8",
        "--max-bytes",
        "4K",
        "--factor",
        "8",
        *QUICK,
    )
    assert code == 0, out
    tables = _tables(out)
    assert list(tables) == list(ALL_OPS)
    for op, (header, rows) in tables.items():
        assert header == COLUMNS, op
        assert rows, op
        for row in rows:
            assert len(row) == len(COLUMNS), row
            assert row[-1] == "0", f"{op}: wrong elements in {row}"
            assert float(row[5]) > 0
    assert "# Out of bounds values : 0 OK" in out
    # root and redop columns follow nccl-tests: -1 / none where the op has none
    assert tables["broadcast"][1][0][3:5] == ["none", "0"]
    assert tables["all_gather"][1][0][3:5] == ["none", "-1"]
    # all-gather sizes are whole elements for every peer: a multiple of 3 * 4 bytes
    assert all(int(row[0]) % 12 == 0 for row in tables["all_gather"][1])


def test_root_redop_and_dtype_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys,
        "--op",
        "reduce,broadcast,all_reduce",
        "--devices",
        "2",
        "--root",
        "1",
        "--redop",
        "max",
        "--dtype",
        "int32",
        "--min-bytes",
        "64",
        "--max-bytes",
        "1K",
        "--factor",
        "4",
        *QUICK,
    )
    assert code == 0, out
    tables = _tables(out)
    assert all(row[2:5] == ["int32", "max", "1"] for row in tables["reduce"][1])
    assert all(row[-1] == "0" for _, rows in tables.values() for row in rows)


def test_json_rows_and_environment(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    code, _, _ = _bench(
        capsys,
        "--op",
        "all_reduce,barrier",
        "--devices",
        "2",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "64K",
        "--factor",
        "4",
        "--json",
        str(path),
        *QUICK,
    )
    assert code == 0
    document = json.loads(path.read_text())
    assert {"environment", "settings", "timing", "rows", "peers"} <= set(document)
    rows = document["rows"]
    assert [r["requested"] for r in rows if r["op"] == "all_reduce"] == [1024, 4096, 16384, 65536]
    for row in rows:
        assert row["wrong"] == 0
        assert len(row["iter_times_us"]) == 3
        assert row["time_us"] > 0
    big = rows[3]
    assert big["busbw"] == pytest.approx(big["algbw"] * 2 * (2 - 1) / 2)
    assert big["algbw"] == pytest.approx(big["size"] / (big["time_us"] * 1e-6) / 1e9)
    assert document["environment"]["numpy"]
    assert document["settings"]["config"]["num_devices"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--op", "all_reduce,bogus"], "invalid --op"),
        (["--min-bytes", "12Q"], "invalid size"),
        (["--max-bytes", "-1"], "invalid size"),
        (["--dtype", "complex64"], "invalid --dtype"),
        (["--vs", "nccl"], "invalid --vs"),
        (["--iters", "0"], "at least 1"),
    ],
)
def test_bad_arguments_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-bytes", "1M", "--max-bytes", "1K"], "larger than --max-bytes"),
        (["--factor", "1"], "--factor must be greater than 1"),
        (["--devices", "2", "--root", "2"], "--root 2 is not a peer id"),
        (["--strategy", "spiral"], "accepted"),
    ],
)
def test_inconsistent_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _bench(capsys, *argv)
    assert code == 2
    assert message in err


def test_tcp_and_numpy_baselines_add_ratio_columns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys,
        "--devices",
        "2",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "16K",
        "--factor",
        "4",
        "--vs",
        "tcp,numpy",
        *QUICK,
    )
    assert code == 0, out
    header, rows = _tables(out)["all_reduce"]
    assert header[len(COLUMNS) :] == ["vs tcp", "vs numpy"]
    for row in rows:
        assert float(row[-2]) > 0 and float(row[-1]) > 0
    assert "# vs tcp: TCP loopback" in out


def test_naive_baseline_runs_a_thread_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys, "--devices", "3", "--min-bytes", "1K", "--max-bytes", "4K", "--factor", "4",
        "--vs", "naive", *QUICK,
    )
    assert code == 0, out
    header, rows = _tables(out)["all_reduce"]
    assert header[-1] == "vs naive"
    assert all(float(row[-1]) > 0 for row in rows)
    assert "# vs naive: chunked naive all-reduce, 3 threads" in out


def test_the_naive_baseline_times_each_size() -> None:
    from burncoll.bench import peers

    rows = peers.naive_threads([4096], "float32", iters=2, warmup=1, world=3)
    assert len(rows) == 1 and rows[0].count == 1024 and rows[0].time_us > 0


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_gloo_baseline_adds_ratio_column(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys, "--devices", "2", "--min-bytes", "64", "--max-bytes", "64", "--vs", "gloo", *QUICK
    )
    assert code == 0, out
    header, rows = _tables(out)["all_reduce"]
    assert header[-1] == "vs gloo"
    assert float(rows[0][-1]) > 0


@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
    reason="mpi4py or mpirun not installed",
)
def test_mpi_baseline_adds_ratio_column(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(
        capsys, "--devices", "2", "--min-bytes", "1K", "--max-bytes", "1K", "--vs", "mpi", *QUICK
    )
    assert code == 0, out
    header, rows = _tables(out)["all_reduce"]
    assert header[-1] == "vs mpi"
    assert float(rows[0][-1]) > 0


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed"
)
def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "busbw.png"
    code, _, _ = _bench(
        capsys,
        "--devices",
        "2",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "4K",
        "--plot",
        str(path),
        *QUICK,
    )
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_nodes_through_launch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bench(
        capsys,
        "--nodes",
        "2",
        "--devices",
        "1",
        "--op",
        "all",
        "--min-bytes",
        "64",
        "--max-bytes",
        "4K",
        "--factor",
        "8",
        *QUICK,
    )
    assert code == 0, out + err
    tables = _tables(out)
    assert list(tables) == list(ALL_OPS)
    assert all(row[-1] == "0" for _, rows in tables.values() for row in rows)
    assert "[node 0]" not in out.split("# all_reduce")[1]


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax not installed")
def test_config_file_with_the_jax_backend(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "jax.yaml"
    config.write_text("backend: jax\nnum_devices: 3\nlocal_all_reduce_strategy: ring\n")
    path = tmp_path / "out.json"
    code, out, _ = _bench(
        capsys,
        "--config",
        str(config),
        "--devices",
        "2",
        "--op",
        "all_reduce,all_gather",
        "--min-bytes",
        "64",
        "--max-bytes",
        "1K",
        "--factor",
        "16",
        "--json",
        str(path),
        *QUICK,
    )
    assert code == 0, out
    assert all(row[-1] == "0" for _, rows in _tables(out).values() for row in rows)
    settings = json.loads(path.read_text())["settings"]
    assert settings["config"]["backend"] == "jax"
    assert settings["config"]["local_all_reduce_strategy"] == "ring"
    assert settings["devices"] == 2  # the flag overrides the file


def test_a_baseline_that_cannot_run_is_skipped_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _bench(
        capsys,
        "--devices",
        "2",
        "--redop",
        "mean",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "1K",
        "--vs",
        "gloo,mpi,numpy",
        *QUICK,
    )
    assert code == 0, out
    assert "# vs gloo: skipped: redop mean has no gloo equivalent" in out
    assert "# vs mpi: skipped: redop mean has no mpi equivalent" in out
    assert "Traceback" not in out + err
    header, _ = _tables(out)["all_reduce"]
    assert header[len(COLUMNS) :] == ["vs numpy"]


def _busy_loops() -> set[int]:
    """Pids of this user's processes running the load's busy loop."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"while True:\n    pass" in cmdline:
                found.add(int(entry.name))
    return found


def test_load_and_compression_across_two_nodes(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """--load N runs N busy processes for the run and leaves none; --compression reaches every
    node (the results are checked against the reference with the compression's bound)."""
    before = _busy_loops()
    path = tmp_path / "rows.json"
    code, out, err = _bench(capsys, "--nodes", "2", "--devices", "1", "--op", "all_reduce",
                            "-b", "1K", "-e", "64K", "-f", "8", "--load", "2",
                            "--compression", "bf16", "--json", str(path), *QUICK)
    assert code == 0, out + err
    assert "2 CPU-bound processes" in out and "bf16 between nodes" in out
    document = json.loads(path.read_text())
    assert document["settings"]["config"]["compression"] == "bf16"
    assert all(row["wrong"] == 0 for row in document["rows"])
    assert _busy_loops() <= before
