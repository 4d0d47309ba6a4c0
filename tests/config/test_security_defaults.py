"""Secure by default: what CollectiveConfig (and start_orchestrator) refuse, warn about, hide.

A multi-node config that listens on a non-loopback address needs a token (or an explicit
``insecure``); an empty token and one under 16 bytes are refused (saying how to make one);
the token comes from a file or the environment and never shows in ``repr``/``to_dict``; the
TLS mode is checked against the transport. Nothing here opens a socket except where said (no
orchestrator is started on a non-loopback address: the refusals come before any bind).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import burncoll
from burncoll import CollectiveConfig, ConfigError
from burncoll.config.security import is_loopback

REPO = Path(__file__).resolve().parents[2]
TOKEN = "a-long-enough-token-for-tests"  # 29 bytes: over the 16-byte floor
MULTI: dict[str, Any] = {"num_nodes": 2, "global_address": "127.0.0.1:29400"}
HINTS = ("BURNCOLL_AUTH_TOKEN", "BURNCOLL_AUTH_TOKEN_FILE", "auth_token_file", "insecure")


@pytest.fixture(autouse=True)
def no_burncoll_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees only the BURNCOLL_* variables it sets itself."""
    for name in list(os.environ):
        if name.startswith("BURNCOLL_"):
            monkeypatch.delenv(name)
    yield


def write_token(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


# -- non-loopback addresses need a token ------------------------------------------------------


@pytest.mark.parametrize("address", ["0.0.0.0", "10.0.0.5", "[::]", "[2001:db8::1]:5000",
                                     "node7.example", "192.168.1.2:29500"])
def test_a_public_node_address_without_a_token_is_refused(address: str) -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(**MULTI, node_address=address)
    message = str(info.value)
    for hint in ("node_address", *HINTS):
        assert hint in message, (hint, message)


@pytest.mark.parametrize("address", ["127.0.0.1", "127.3.4.5:29500", "[::1]", "[::1]:6000",
                                     "localhost", "LOCALHOST:7000"])
def test_loopback_needs_no_token(address: str) -> None:
    assert CollectiveConfig(**MULTI, node_address=address).auth_token is None


def test_a_token_or_insecure_allows_a_public_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CollectiveConfig(**MULTI, node_address="0.0.0.0", auth_token=TOKEN).auth_token == TOKEN
    assert CollectiveConfig(**MULTI, node_address="0.0.0.0", insecure=True).insecure
    monkeypatch.setenv("BURNCOLL_INSECURE", "yes")
    assert CollectiveConfig(**MULTI, node_address="10.0.0.5").insecure
    monkeypatch.setenv("BURNCOLL_INSECURE", "maybe")
    with pytest.raises(ConfigError, match="BURNCOLL_INSECURE"):
        CollectiveConfig()


def test_a_single_node_config_ignores_its_node_address() -> None:
    assert not CollectiveConfig(node_address="0.0.0.0").is_multi_node


def test_is_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.255.0.9", "::1", "[::1]",
                                        "localhost", "::ffff:127.0.0.1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org", "",
                                            "127.0.0.1.example.org"))


@pytest.mark.parametrize("name", ["multi-node-websocket.yaml", "multi-node-quic.yaml"])
def test_shipped_multi_node_configs_need_a_token_on_a_public_address(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = REPO / "configs" / name
    monkeypatch.setenv("BURNCOLL_NODE_ADDRESS", "10.0.0.5")  # as their comments say to run
    with pytest.raises(ConfigError) as info:
        CollectiveConfig.from_yaml(path)
    assert "BURNCOLL_AUTH_TOKEN" in str(info.value)
    monkeypatch.setenv("BURNCOLL_AUTH_TOKEN_FILE", str(write_token(tmp_path, TOKEN + "\n")))
    assert CollectiveConfig.from_yaml(path).auth_token == TOKEN


# -- the token itself -------------------------------------------------------------------------


def test_an_empty_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="an empty auth_token authenticates nothing"):
        CollectiveConfig(auth_token="")
    monkeypatch.setenv("BURNCOLL_AUTH_TOKEN", "")  # not read as "no token"
    with pytest.raises(ConfigError, match="an empty auth_token authenticates nothing"):
        CollectiveConfig()


def test_a_short_token_is_refused_and_a_long_one_is_not() -> None:
    with pytest.raises(ConfigError, match=r"only 4 bytes.*offline.*at least 16.*secrets"):
        CollectiveConfig(auth_token="abcd")
    with pytest.raises(ConfigError, match=r"only 15 bytes"):
        CollectiveConfig(auth_token="x" * 15)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CollectiveConfig(auth_token="x" * 16)


def test_the_token_never_shows(tmp_path: Path) -> None:
    cfg = CollectiveConfig(auth_token=TOKEN)
    for text in (repr(cfg), str(cfg), str(cfg.to_dict())):
        assert TOKEN not in text and "auth_token" in text
    assert "auth_token='***'" in repr(cfg)
    assert cfg.to_dict()["auth_token"] == "***"
    assert cfg.to_dict(reveal_token=True)["auth_token"] == TOKEN
    assert "auth_token=None" in repr(CollectiveConfig())
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(auth_token=TOKEN, auth_token_file=str(write_token(tmp_path, "other" * 5)))
    assert TOKEN not in str(info.value) and "other" not in str(info.value)


def test_the_environment_gives_the_token_unless_the_code_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BURNCOLL_AUTH_TOKEN", TOKEN + "-from-env")
    assert CollectiveConfig().auth_token == TOKEN + "-from-env"
    assert CollectiveConfig(auth_token=TOKEN).auth_token == TOKEN  # the code's argument wins
    path = tmp_path / "c.yaml"
    path.write_text(f"auth_token: {TOKEN}\n")
    assert CollectiveConfig.from_yaml(path).auth_token == TOKEN + "-from-env"  # env beats a file


# -- token files ------------------------------------------------------------------------------


def test_a_token_file_is_read_without_its_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_token(tmp_path, TOKEN + "\n")
    cfg = CollectiveConfig(**MULTI, node_address="0.0.0.0", auth_token_file=str(path))
    assert cfg.auth_token == TOKEN and cfg.auth_token_file == str(path)
    assert cfg.replace(timeout=5).auth_token == TOKEN
    # the same token given both ways is fine; through the environment too
    assert CollectiveConfig(auth_token=TOKEN, auth_token_file=str(path)).auth_token == TOKEN
    monkeypatch.setenv("BURNCOLL_AUTH_TOKEN_FILE", str(path))
    assert CollectiveConfig().auth_token == TOKEN
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"auth_token_file: {path}\n")
    monkeypatch.delenv("BURNCOLL_AUTH_TOKEN_FILE")
    assert CollectiveConfig.from_yaml(yaml).auth_token == TOKEN


@pytest.mark.parametrize(("content", "problem"), [
    (None, "cannot read"),
    ("", "empty"),
    ("\n", "empty"),
    ("x" * 5000, "over 4096 bytes"),
])
def test_a_bad_token_file_is_an_error_naming_the_path(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        write_token(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(auth_token_file=str(path))
    assert str(path) in str(info.value) and problem in str(info.value)


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_a_token_file_others_can_read_warns(tmp_path: Path) -> None:
    path = write_token(tmp_path, TOKEN, mode=0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        assert CollectiveConfig(auth_token_file=str(path)).auth_token == TOKEN


# -- tls and integrity ------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"transport": "quic", "tls": False}, ["QUIC always runs TLS"]),
    ({"transport": "websocket", "tls": False, "tls_ca": "ca.pem"}, ["tls=false", "tls_ca"]),
    ({"transport": "tcp", "tls": True}, ["tcp", "no TLS"]),
    ({"tls": "yes"}, ["tls='yes'"]),
    ({"integrity": 1}, ["integrity=1"]),
    ({"insecure": "no"}, ["insecure='no'"]),
])
def test_bad_security_settings_name_the_field(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        CollectiveConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_tls_modes_and_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = CollectiveConfig(**MULTI, node_address="127.0.0.1")
    assert not plain.uses_tls and not plain.tls_settings().wanted
    wss = plain.with_tls_mode(True)
    assert wss.uses_tls and wss.tls_settings().ephemeral
    assert plain.with_transport("quic").uses_tls
    assert plain.replace(tls_ca="ca.pem").uses_tls  # automatic: a path means wss
    assert plain.with_transport("tcp").with_tls_mode(False).tls is False
    fingerprints = [c.global_fingerprint() for c in (plain, wss, plain.with_integrity(True))]
    assert fingerprints[0]["tls"] is False and fingerprints[1]["tls"] is True
    assert fingerprints[2]["integrity"] is True and fingerprints[0]["integrity"] is False
    assert fingerprints[0] != fingerprints[1] != fingerprints[2]
    monkeypatch.setenv("BURNCOLL_TLS", "auto")
    monkeypatch.setenv("BURNCOLL_INTEGRITY", "on")
    assert CollectiveConfig().tls is None and CollectiveConfig().integrity
    cfg = CollectiveConfig(tls=True)  # the code's argument wins over BURNCOLL_TLS
    assert cfg.tls is True and cfg.integrity
    monkeypatch.setenv("BURNCOLL_TLS", "off")
    assert CollectiveConfig().tls is False


# -- the orchestrator -------------------------------------------------------------------------


def test_start_orchestrator_refuses_a_public_host_without_a_token() -> None:
    with pytest.raises(ConfigError) as info:
        burncoll.start_orchestrator(host="0.0.0.0")
    for hint in ("0.0.0.0", "BURNCOLL_AUTH_TOKEN", "--insecure"):
        assert hint in str(info.value)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"auth_token": ""}, ["an empty auth_token authenticates nothing"]),
    ({"transport": "quic", "tls": False}, ["QUIC always runs TLS"]),
    ({"expected_nodes": 0}, ["expected_nodes"]),
])
def test_start_orchestrator_checks_its_settings(kwargs: dict[str, Any],
                                                words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        burncoll.start_orchestrator(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_start_orchestrator_refuses_a_short_token() -> None:
    with pytest.raises(ConfigError, match="the orchestrator's auth token is only 3 bytes"):
        burncoll.start_orchestrator(auth_token="abc")  # even on loopback
