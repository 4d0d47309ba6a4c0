"""CollectiveConfig: defaults, validation, builders, YAML and environment."""

from __future__ import annotations

from pathlib import Path

import pytest

import burncoll
from burncoll import CollectiveConfig, ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_defaults_choose_the_strategy_per_operation() -> None:
    cfg = CollectiveConfig()
    for name in ("local_all_reduce_strategy", "local_reduce_strategy",
                 "local_broadcast_strategy", "global_all_reduce_strategy",
                 "global_reduce_strategy", "global_broadcast_strategy"):
        assert cfg.strategy(name) == burncoll.Auto(), name
    assert cfg.num_nodes is None and cfg.global_address is None
    assert cfg.transport == "websocket" and cfg.backend == "numpy"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_devices": 0}, ["num_devices", ">= 1"]),
        ({"local_all_reduce_strategy": "tree:0"}, ["local_all_reduce_strategy", "arity"]),
        ({"global_reduce_strategy": "butterfly"}, ["global_reduce_strategy", "'ring'"]),
        ({"num_nodes": 2}, ["num_nodes=2", "global_address", "BURNCOLL_GLOBAL_ADDRESS"]),
        ({"backend": "tensorflow"}, ["backend", "numpy", "torch"]),
        ({"transport": "udp"}, ["transport", "websocket"]),
        ({"timeout": 0}, ["timeout"]),
        ({"timeout": float("inf")}, ["timeout=inf", "at most 2.592e+06", "finite"]),
        ({"timeout": 1e12}, ["timeout=1000000000000.0", "at most"]),
        ({"num_nodes": 2, "global_address": "x", "node_address": "127.0.0.1"},
         ["global_address", "port"]),
        ({"tls_cert": "a.pem"}, ["tls_key"]),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    for name in names:
        assert name in str(info.value)


def test_strategy_spellings_and_builders() -> None:
    cfg = CollectiveConfig().with_local_all_reduce_strategy("tree:4").with_num_devices(3)
    assert cfg.local_all_reduce_strategy == burncoll.Tree(4) and cfg.num_devices == 3
    assert CollectiveConfig(local_reduce_strategy="ring").local_reduce_strategy == burncoll.Ring()
    assert CollectiveConfig(local_reduce_strategy="tree").local_reduce_strategy == burncoll.Tree(2)
    doubling = CollectiveConfig(global_all_reduce_strategy="doubling").global_all_reduce_strategy
    assert doubling == burncoll.Doubling()
    cfg2 = cfg.with_global_address("ws://127.0.0.1:4000").with_node_address(
        "127.0.0.1").with_num_nodes(2)
    assert cfg2.is_multi_node and not cfg.is_multi_node


def test_yaml_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("num_devices: 3\nlocal_all_reduce_strategy: ring\ntimeout: 5\n")
    cfg = CollectiveConfig.from_yaml(path)
    assert cfg.num_devices == 3 and cfg.local_all_reduce_strategy == burncoll.Ring()
    monkeypatch.setenv("BURNCOLL_NUM_DEVICES", "5")
    monkeypatch.setenv("BURNCOLL_GLOBAL_ALL_REDUCE_STRATEGY", "centralized")
    cfg = CollectiveConfig.from_yaml(path)
    assert cfg.num_devices == 5 and cfg.global_all_reduce_strategy == burncoll.Centralized()
    monkeypatch.setenv("BURNCOLL_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="BURNCOLL_TIMEOUT"):
        CollectiveConfig()


def test_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_devices: 2\nnum_gpus: 3\n")
    with pytest.raises(ConfigError, match="num_gpus"):
        CollectiveConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        CollectiveConfig.from_yaml(tmp_path / "missing.yaml")
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        CollectiveConfig.from_yaml(bad)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load(path: Path) -> None:
    assert isinstance(CollectiveConfig.from_yaml(path), CollectiveConfig)
