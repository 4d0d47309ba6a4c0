"""Where each config value comes from: the code, then BURNCOLL_* variables, then a YAML file,
then the launcher's variables, then the defaults; and what node 0 of a launched job does."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import burncoll
from burncoll import CollectiveConfig, ConfigError, TransportError
from burncoll.train import ddp

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_the_code_beats_the_environment_which_beats_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("timeout: 7\nnum_devices: 3\n")
    assert CollectiveConfig().timeout == 60.0  # the default
    assert CollectiveConfig.from_yaml(path).timeout == 7  # the file
    monkeypatch.setenv("BURNCOLL_TIMEOUT", "9")
    assert CollectiveConfig().timeout == 9  # the environment over the default
    assert CollectiveConfig.from_yaml(path).timeout == 9  # ... and over the file
    assert CollectiveConfig.from_yaml(path).num_devices == 3
    assert CollectiveConfig(timeout=5).timeout == 5  # the code over everything
    assert CollectiveConfig.from_mapping({"timeout": 4}).timeout == 4
    assert CollectiveConfig().replace(timeout=3).timeout == 3


def test_torchrun_variables_make_a_two_node_config(torchrun_env: pytest.MonkeyPatch) -> None:
    cfg = CollectiveConfig()
    assert (cfg.num_nodes, cfg.node_rank) == (2, 0)
    # torchrun's agent holds MASTER_PORT with torch's store: burncoll takes the next port
    assert cfg.global_address == "127.0.0.1:29512"
    assert cfg.host_orchestrator is True and cfg.node_address == "127.0.0.1"
    assert burncoll.peer_ids(cfg) == (0,) and burncoll.peer_ids(cfg, num_devices=2) == (0, 1)
    torchrun_env.setenv("RANK", "1")
    torchrun_env.setenv("LOCAL_RANK", "1")
    other = CollectiveConfig(num_devices=2)
    assert other.node_rank == 1 and other.host_orchestrator is False
    assert burncoll.peer_ids(other) == (2, 3) and burncoll.node_rank(other) == 1


def test_settings_given_elsewhere_win_over_the_launcher(
    torchrun_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert CollectiveConfig(num_nodes=1).num_nodes == 1  # the code chose one node
    explicit = CollectiveConfig(global_address="127.0.0.1:4000")
    assert explicit.global_address == "127.0.0.1:4000"
    assert explicit.host_orchestrator is None  # someone else runs that orchestrator
    path = tmp_path / "c.yaml"
    path.write_text("num_nodes: 1\n")
    assert CollectiveConfig.from_yaml(path).num_nodes == 1
    torchrun_env.setenv("BURNCOLL_GLOBAL_ADDRESS", "127.0.0.1:4001")
    from_env = CollectiveConfig()  # the variable moves the rendezvous node 0 hosts
    assert from_env.global_address == "127.0.0.1:4001" and from_env.host_orchestrator
    assert from_env.num_nodes == 2  # the other fields still come from torchrun
    torchrun_env.setenv("BURNCOLL_HOST_ORCHESTRATOR", "0")  # an orchestrator of one's own
    assert CollectiveConfig().host_orchestrator is False
    torchrun_env.delenv("BURNCOLL_HOST_ORCHESTRATOR")
    torchrun_env.setenv("RANK", "1")
    torchrun_env.setenv("LOCAL_RANK", "1")
    assert CollectiveConfig(num_nodes=1).node_rank is None  # another job size: no launcher


def test_launcher_variables_that_do_not_add_up(torchrun_env: pytest.MonkeyPatch) -> None:
    torchrun_env.setenv("RANK", "5")
    with pytest.raises(ConfigError) as info:
        CollectiveConfig()
    assert "RANK" in str(info.value) and "WORLD_SIZE" in str(info.value)
    # the code set every field a launcher gives: its variables are not read at all
    cfg = CollectiveConfig(num_nodes=1, node_rank=0, global_address=None)
    assert cfg.num_nodes == 1


def test_a_bad_node_rank_names_both_fields() -> None:
    with pytest.raises(ConfigError, match="node_rank=2 but num_nodes=2"):
        CollectiveConfig(num_nodes=2, node_rank=2, global_address="127.0.0.1:1")
    with pytest.raises(ConfigError, match="node_rank=-1"):
        CollectiveConfig(node_rank=-1)
    with pytest.raises(ConfigError, match="host_orchestrator"):
        CollectiveConfig(host_orchestrator="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="global_address"):
        CollectiveConfig(host_orchestrator=True)


def _routable_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed by a default route, never sent
            return str(probe.getsockname()[0])
    except OSError:
        return None


def test_the_node_address_is_found_toward_the_rendezvous_host() -> None:
    if _routable_address() is None:
        pytest.skip("this machine has no route beyond loopback")
    with pytest.raises(ConfigError) as info:  # a public address needs a token
        CollectiveConfig(num_nodes=2, global_address="192.0.2.1:29400")
    assert "found" in str(info.value) and "BURNCOLL_AUTH_TOKEN" in str(info.value)
    cfg = CollectiveConfig(num_nodes=2, global_address="192.0.2.1:29400",
                           auth_token="t" * 32)
    assert cfg.node_address is not None and not cfg.node_address.startswith("127.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((cfg.node_address, 0))  # an address of this machine
    loop = CollectiveConfig(num_nodes=2, global_address="localhost:29400")
    assert loop.node_address == "127.0.0.1"


def test_node_zero_says_which_port_it_cannot_host_on(torchrun_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        torchrun_env.setenv("MASTER_PORT", str(port - 1))
        dp = ddp(range(1), CollectiveConfig(timeout=5))
        with pytest.raises(TransportError) as info:
            dp.run(lambda comm: None)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "BURNCOLL_GLOBAL_ADDRESS" in message


def test_replace_finds_derived_values_again(torchrun_env: pytest.MonkeyPatch) -> None:
    node0 = CollectiveConfig(num_devices=2)
    assert node0.host_orchestrator and node0.node_address == "127.0.0.1"
    assert node0.replace(num_devices=1).host_orchestrator  # as ddp() does: still hosts
    moved = node0.replace(global_address="127.0.0.1:4100")  # the code moved the rendezvous
    assert moved.host_orchestrator is None and moved.num_nodes == 2
    assert moved.num_devices == 2  # what the code gave stays


def test_a_bare_ipv6_node_address_is_a_host() -> None:
    cfg = CollectiveConfig(num_nodes=2, global_address="[::1]:4000")
    assert cfg.node_address == "::1"


def test_a_job_over_hosts_cannot_meet_on_loopback(torchrun_env: pytest.MonkeyPatch) -> None:
    torchrun_env.setenv("WORLD_SIZE", "4")  # 2 per host, 2 hosts
    torchrun_env.setenv("MASTER_ADDR", "127.0.1.1")  # as /etc/hosts maps the host name
    with pytest.raises(ConfigError, match="spans several hosts"):
        CollectiveConfig()
