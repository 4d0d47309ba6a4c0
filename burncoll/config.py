"""``CollectiveConfig``: one frozen dataclass describing a collective, validated on creation.

Values come from, in increasing priority: the field defaults, the constructor (or a YAML file
through :meth:`CollectiveConfig.from_yaml`), then ``BURNCOLL_<FIELD>`` environment variables
(``BURNCOLL_NUM_NODES=2``). ``burncoll launch`` hands each node its addresses that way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from burncoll.errors import ConfigError
from burncoll.strategies import Auto, Strategy, parse_strategy

__all__ = ["BACKENDS", "TRANSPORTS", "CollectiveConfig", "parse_host_port"]

BACKENDS = ("numpy", "jax", "cupy")
TRANSPORTS = ("websocket", "quic", "tcp")
ENV_PREFIX = "BURNCOLL_"
_STRATEGY_FIELDS = (
    "local_all_reduce_strategy",
    "local_reduce_strategy",
    "local_broadcast_strategy",
    "global_all_reduce_strategy",
    "global_reduce_strategy",
    "global_broadcast_strategy",
)


@dataclass(frozen=True)
class CollectiveConfig:
    """How a collective is laid out, which algorithms it uses, and how nodes talk.

    Build it with keywords, ``with_<field>(value)`` builders, :meth:`from_yaml`, or
    ``BURNCOLL_<FIELD>`` environment variables (which override everything else). Invalid values
    raise :class:`~burncoll.ConfigError` naming the field and what it accepts.
    """

    #: Array library: ``"numpy"`` (CPU), ``"jax"`` or ``"cupy"``.
    backend: str = "numpy"
    #: Number of local peers (threads, one per device) on this node.
    num_devices: int = 1
    #: Local-level strategy for all-reduce, reduce-scatter and all-gather.
    local_all_reduce_strategy: Strategy | str = field(default_factory=Auto)
    #: Local-level strategy for reduce.
    local_reduce_strategy: Strategy | str = field(default_factory=Auto)
    #: Local-level strategy for broadcast.
    local_broadcast_strategy: Strategy | str = field(default_factory=Auto)
    #: Number of nodes (processes); ``None`` or 1 for a single node.
    num_nodes: int | None = None
    #: The orchestrator's address, ``"host:port"`` or ``"ws://host:port"``; multi-node only.
    global_address: str | None = None
    #: The host (or ``host:port``) other nodes use to reach this node's data service; the data
    #: service binds this host. Multi-node only.
    node_address: str | None = None
    #: The data service's port; 0 or ``None`` picks a free one (reported to the orchestrator).
    data_service_port: int | None = None
    #: Global-level strategy for all-reduce, reduce-scatter and all-gather between nodes.
    global_all_reduce_strategy: Strategy | str = field(default_factory=Auto)
    #: Global-level strategy for reduce between nodes.
    global_reduce_strategy: Strategy | str = field(default_factory=Auto)
    #: Global-level strategy for broadcast between nodes.
    global_broadcast_strategy: Strategy | str = field(default_factory=Auto)
    #: Node-to-node transport: ``"websocket"``, ``"quic"`` or ``"tcp"``.
    transport: str = "websocket"
    #: Seconds any single wait may take (registration, each operation, finish).
    timeout: float = 60.0
    #: Shared secret authenticating every connection (challenge-response; never sent).
    auth_token: str | None = None
    #: PEM certificate for this node's listeners (wss / QUIC); ``None`` = ephemeral self-signed.
    tls_cert: str | None = None
    #: PEM private key matching ``tls_cert``.
    tls_key: str | None = None
    #: PEM CA bundle used to verify other nodes' certificates; ``None`` = trust by token only.
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            raw = os.environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                object.__setattr__(self, f.name, _parse_env(f.name, raw))
        for name in _STRATEGY_FIELDS:
            object.__setattr__(self, name, _strategy(name, getattr(self, name)))
        _validate(self)

    # -- derived views ----------------------------------------------------------------------
    @property
    def is_multi_node(self) -> bool:
        """True when more than one node takes part."""
        return (self.num_nodes or 1) > 1

    def strategy(self, name: str) -> Strategy:
        """The validated strategy of field ``name`` (e.g. ``"global_reduce_strategy"``)."""
        value = getattr(self, name)
        if not isinstance(value, Strategy):  # pragma: no cover - normalised in __post_init__
            raise ConfigError(f"{name} is not a strategy")
        return value

    def global_fingerprint(self) -> dict[str, Any]:
        """The fields every node must agree on; the orchestrator compares them."""
        return {
            "num_nodes": self.num_nodes,
            "global_all_reduce_strategy": self.strategy("global_all_reduce_strategy").spec,
            "global_reduce_strategy": self.strategy("global_reduce_strategy").spec,
            "global_broadcast_strategy": self.strategy("global_broadcast_strategy").spec,
            "transport": self.transport,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain values (strategies as their spelling), as a YAML file would hold them."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.spec if isinstance(value, Strategy) else value
        return out

    # -- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> CollectiveConfig:
        """Read a YAML mapping whose keys are field names; environment variables override."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
        return cls.from_mapping(data, source=str(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "mapping") -> CollectiveConfig:
        """Build from a mapping of field names to values; unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; "
                f"valid keys: {', '.join(sorted(names))}"
            )
        return cls(**{str(k): v for k, v in data.items()})

    def replace(self, **changes: Any) -> CollectiveConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_backend(self, value: str) -> CollectiveConfig:
        return self.replace(backend=value)

    def with_num_devices(self, value: int) -> CollectiveConfig:
        return self.replace(num_devices=value)

    def with_local_all_reduce_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(local_all_reduce_strategy=value)

    def with_local_reduce_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(local_reduce_strategy=value)

    def with_local_broadcast_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(local_broadcast_strategy=value)

    def with_num_nodes(self, value: int | None) -> CollectiveConfig:
        return self.replace(num_nodes=value)

    def with_global_address(self, value: str | None) -> CollectiveConfig:
        return self.replace(global_address=value)

    def with_node_address(self, value: str | None) -> CollectiveConfig:
        return self.replace(node_address=value)

    def with_data_service_port(self, value: int | None) -> CollectiveConfig:
        return self.replace(data_service_port=value)

    def with_global_all_reduce_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(global_all_reduce_strategy=value)

    def with_global_reduce_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(global_reduce_strategy=value)

    def with_global_broadcast_strategy(self, value: Strategy | str) -> CollectiveConfig:
        return self.replace(global_broadcast_strategy=value)

    def with_transport(self, value: str) -> CollectiveConfig:
        return self.replace(transport=value)

    def with_timeout(self, value: float) -> CollectiveConfig:
        return self.replace(timeout=value)

    def with_auth_token(self, value: str | None) -> CollectiveConfig:
        return self.replace(auth_token=value)

    def with_tls(
        self, cert: str | None, key: str | None, ca: str | None = None
    ) -> CollectiveConfig:
        return self.replace(tls_cert=cert, tls_key=key, tls_ca=ca)


# -- parsing and validation -------------------------------------------------------------------


def parse_host_port(
    value: str, field_name: str, default_port: int | None = None
) -> tuple[str, int]:
    """``"host:port"``, ``"ws://host:port/path"``, ``"quic://[::1]:5000"`` -> ``(host, port)``."""
    text = value.strip()
    split = urlsplit(text if "://" in text else "//" + text)
    try:
        port = split.port
    except ValueError as exc:
        raise ConfigError(f"{field_name}={value!r}: the port is not a number 0-65535") from exc
    host = split.hostname
    if not host:
        raise ConfigError(f"{field_name}={value!r}: expected 'host:port' or 'ws://host:port'")
    if port is None:
        if default_port is None:
            raise ConfigError(f"{field_name}={value!r}: the port is missing; use 'host:port'")
        port = default_port
    return host, port


def _strategy(name: str, value: object) -> Strategy:
    if isinstance(value, Strategy):
        return value
    if isinstance(value, str):
        try:
            return parse_strategy(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    raise ConfigError(
        f"{name}={value!r}: expected burncoll.Centralized(), Tree(k), Ring() or one of "
        "'centralized', 'tree', 'tree:K', 'ring'"
    )


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "null") else int(text)


def _parse_optional_str(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none", "null") else text


_ENV_PARSERS: dict[str, Callable[[str], Any]] = {
    "num_devices": int,
    "num_nodes": _parse_optional_int,
    "data_service_port": _parse_optional_int,
    "timeout": float,
    "global_address": _parse_optional_str,
    "node_address": _parse_optional_str,
    "auth_token": _parse_optional_str,
    "tls_cert": _parse_optional_str,
    "tls_key": _parse_optional_str,
    "tls_ca": _parse_optional_str,
}


def _parse_env(name: str, raw: str) -> Any:
    parser = _ENV_PARSERS.get(name, str)
    try:
        return parser(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {ENV_PREFIX}{name.upper()}={raw!r} is not a valid {name}"
        ) from None


def _require_int(cfg: CollectiveConfig, name: str, minimum: int, optional: bool) -> None:
    value = getattr(cfg, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")


def _validate(cfg: CollectiveConfig) -> None:
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend={cfg.backend!r}: expected one of {', '.join(BACKENDS)}")
    if cfg.transport not in TRANSPORTS:
        raise ConfigError(f"transport={cfg.transport!r}: expected one of {', '.join(TRANSPORTS)}")
    _require_int(cfg, "num_devices", 1, optional=False)
    _require_int(cfg, "num_nodes", 1, optional=True)
    _require_int(cfg, "data_service_port", 0, optional=True)
    if cfg.data_service_port is not None and cfg.data_service_port > 65535:
        raise ConfigError(f"data_service_port={cfg.data_service_port}: expected 0-65535")
    timeout = cfg.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"timeout={timeout!r}: expected a number of seconds > 0")
    for name in ("auth_token", "tls_cert", "tls_key", "tls_ca", "global_address", "node_address"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name}={value!r}: expected a string or None")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("tls_cert and tls_key must be given together (PEM file paths)")
    if cfg.is_multi_node:
        missing = [n for n in ("global_address", "node_address") if getattr(cfg, n) is None]
        if missing:
            raise ConfigError(
                f"num_nodes={cfg.num_nodes} needs {' and '.join(missing)}: set "
                "global_address='host:port' of the orchestrator and node_address='host' "
                "that other nodes can reach"
            )
    if cfg.global_address is not None:
        parse_host_port(cfg.global_address, "global_address")
    if cfg.node_address is not None:
        parse_host_port(cfg.node_address, "node_address", default_port=0)
