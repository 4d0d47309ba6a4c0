"""``CollectiveConfig``: one frozen dataclass describing a collective, validated on creation.

Values come from, in increasing priority: the field defaults, the constructor (or a YAML file
through :meth:`CollectiveConfig.from_yaml`), then ``BURNCOLL_<FIELD>`` environment variables
(``BURNCOLL_NUM_NODES=2``). ``burncoll launch`` hands each node its addresses that way.

Secure by default: a multi-node config whose ``node_address`` is not a loopback address
(``127.0.0.0/8``, ``::1``, ``localhost``) must carry an ``auth_token`` (or ``auth_token_file``)
unless ``insecure`` is set; an empty token is refused and one shorter than
:data:`MIN_TOKEN_BYTES` bytes draws a :class:`UserWarning`. ``repr`` and
:meth:`~CollectiveConfig.to_dict` never show the token.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from burncoll.errors import ConfigError
from burncoll.strategies import Auto, Strategy, parse_strategy
from burncoll.transport.base import TlsSettings

__all__ = [
    "BACKENDS",
    "MIN_TOKEN_BYTES",
    "TRANSPORTS",
    "CollectiveConfig",
    "check_bind_address",
    "check_tls_mode",
    "check_token",
    "is_loopback",
    "parse_host_port",
    "read_token_file",
    "resolve_token",
]

BACKENDS = ("numpy", "jax", "cupy")
TRANSPORTS = ("websocket", "quic", "tcp")
ENV_PREFIX = "BURNCOLL_"
#: Tokens shorter than this (in UTF-8 bytes) draw a warning: an HMAC over a sniffed handshake
#: lets anyone test guesses offline, and a 4-letter token fell in 0.2 s.
MIN_TOKEN_BYTES = 16
#: Largest token file read (a token is a line; anything larger is a wrong path).
TOKEN_FILE_LIMIT = 4096
#: What :func:`repr` and :meth:`CollectiveConfig.to_dict` show instead of a token.
REDACTED = "***"
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
    #: Shared secret authenticating every connection (challenge-response; never sent). Prefer
    #: ``auth_token_file`` or the ``BURNCOLL_AUTH_TOKEN`` environment variable to writing it
    #: in a file others read. ``""`` is refused; under 16 bytes draws a warning.
    auth_token: str | None = None
    #: A file holding the token (its trailing newline stripped), read on creation; a missing,
    #: unreadable or empty file is an error. Must agree with ``auth_token`` when both are set.
    auth_token_file: str | None = None
    #: Allow a multi-node ``node_address`` other than loopback *without* a token: anyone who
    #: reaches the address can then join the collective and read or change its data.
    insecure: bool = False
    #: Tag every message on tcp/websocket connections with a per-connection HMAC (key derived
    #: from the token and both nonces), so a relay cannot alter data undetected. Every node
    #: and the orchestrator must agree.
    integrity: bool = False
    #: PEM certificate for this node's listeners (wss / QUIC); ``None`` = ephemeral self-signed.
    tls_cert: str | None = None
    #: PEM private key matching ``tls_cert``.
    tls_key: str | None = None
    #: PEM CA bundle used to verify other nodes' certificates; ``None`` = trust by token only.
    tls_ca: str | None = None
    #: TLS mode. ``None`` (automatic): QUIC always uses TLS, WebSocket uses ``wss`` when a
    #: ``tls_*`` path is set. ``True``: ``wss`` even without certificates (ephemeral ones; the
    #: token authentication is then bound to the certificate, which defeats a relay).
    #: ``False``: plain ``ws`` (an error with QUIC, or with ``tls_*`` paths). Not for tcp.
    tls: bool | None = None

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

    @property
    def uses_tls(self) -> bool:
        """Whether node-to-node connections run TLS (QUIC always; ``wss`` for WebSocket)."""
        if self.transport == "quic":
            return True
        if self.transport != "websocket":
            return False
        return self.tls_settings().wanted

    def tls_settings(self) -> TlsSettings:
        """The transports' TLS settings: the certificate paths, ephemeral when ``tls`` is on."""
        if self.tls is False:
            return TlsSettings()
        return TlsSettings(self.tls_cert, self.tls_key, self.tls_ca, ephemeral=bool(self.tls))

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
            "integrity": self.integrity,
            "tls": self.uses_tls,
        }

    def to_dict(self, *, reveal_token: bool = False) -> dict[str, Any]:
        """Plain values (strategies as their spelling), as a YAML file would hold them.

        The token shows as ``"***"`` unless ``reveal_token`` (nothing in burncoll needs it:
        child processes get the token through their environment).
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.spec if isinstance(value, Strategy) else value
        if out["auth_token"] is not None and not reveal_token:
            out["auth_token"] = REDACTED
        return out

    def __repr__(self) -> str:
        """Every field, the token shown as ``'***'``."""
        shown = ", ".join(f"{name}={value!r}" for name, value in self.to_dict().items())
        return f"CollectiveConfig({shown})"

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

    def with_auth_token_file(self, value: str | None) -> CollectiveConfig:
        return self.replace(auth_token_file=value)

    def with_insecure(self, value: bool) -> CollectiveConfig:
        return self.replace(insecure=value)

    def with_integrity(self, value: bool) -> CollectiveConfig:
        return self.replace(integrity=value)

    def with_tls_mode(self, value: bool | None) -> CollectiveConfig:
        """Set ``tls`` (``None`` automatic, ``True`` wss, ``False`` plain ws)."""
        return self.replace(tls=value)

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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(text)


def _parse_optional_bool(text: str) -> bool | None:
    if text.strip().lower() in ("", "auto", "none", "null"):
        return None
    return _parse_bool(text)


_ENV_PARSERS: dict[str, Callable[[str], Any]] = {
    "num_devices": int,
    "num_nodes": _parse_optional_int,
    "data_service_port": _parse_optional_int,
    "timeout": float,
    "global_address": _parse_optional_str,
    "node_address": _parse_optional_str,
    "auth_token": str,  # "" stays "": an empty token is refused, never read as "no token"
    "auth_token_file": _parse_optional_str,
    "insecure": _parse_bool,
    "integrity": _parse_bool,
    "tls": _parse_optional_bool,
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
    for name in ("auth_token", "auth_token_file", "tls_cert", "tls_key", "tls_ca",
                 "global_address", "node_address"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            shown = REDACTED if name == "auth_token" else repr(value)
            raise ConfigError(f"{name}={shown}: expected a string or None")
    for name in ("insecure", "integrity"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={getattr(cfg, name)!r}: expected true or false")
    if isinstance(cfg.tls, str) and cfg.tls.strip().lower() == "auto":
        object.__setattr__(cfg, "tls", None)  # YAML ``tls: auto``, as BURNCOLL_TLS=auto
    if cfg.tls is not None and not isinstance(cfg.tls, bool):
        raise ConfigError(f"tls={cfg.tls!r}: expected true, false or auto (null)")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("tls_cert and tls_key must be given together (PEM file paths)")
    check_tls_mode(cfg.transport, cfg.tls, (cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    object.__setattr__(cfg, "auth_token", resolve_token(cfg.auth_token, cfg.auth_token_file))
    if cfg.integrity and cfg.auth_token is None and cfg.is_multi_node:
        warnings.warn(
            "integrity: true without an auth_token protects little: the connections to the "
            "orchestrator then have no key, and the session secret that keys the connections "
            "between nodes travels over them; " + _HOW_TO_SET_A_TOKEN,
            UserWarning, stacklevel=4)
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
        host, _ = parse_host_port(cfg.node_address, "node_address", default_port=0)
        if cfg.is_multi_node:
            check_bind_address(host, cfg.auth_token, cfg.insecure, f"node_address={host!r}",
                               "insecure: true (BURNCOLL_INSECURE=1)")


# -- security checks, shared with the orchestrator and the CLI -------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``127.0.0.0/8``, ``::1`` or ``localhost``.

    Any other name is taken as reachable from elsewhere (``0.0.0.0`` and ``::`` bind every
    interface; a host name may resolve to anything).
    """
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


_HOW_TO_SET_A_TOKEN = (
    "set a shared token on every node and on the orchestrator: BURNCOLL_AUTH_TOKEN=<secret> "
    "or BURNCOLL_AUTH_TOKEN_FILE=<path> in the environment, or auth_token_file: <path> in the "
    "config (make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
)


def check_bind_address(
    host: str, token: str | None, insecure: bool, subject: str, override: str
) -> None:
    """Refuse to listen on a non-loopback ``host`` without a token unless ``insecure``.

    :class:`ConfigError` naming the ``subject`` (``"node_address='0.0.0.0'"``), how to set a
    token, and the ``override`` that accepts the risk.
    """
    if token is not None or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"{subject} is reachable from other machines, and no auth token is set: anyone who "
        "reaches it could join the collective and read or change its data. To fix it, "
        f"{_HOW_TO_SET_A_TOKEN}; or, on a network you fully trust, set {override} to run "
        "without authentication"
    )


def check_token(token: str | None, what: str = "auth_token") -> None:
    """Refuse an empty token; warn (:class:`UserWarning`) about one under 16 bytes."""
    if token is None:
        return
    if token == "":
        raise ConfigError(
            f"{what}: an empty auth_token authenticates nothing; {_HOW_TO_SET_A_TOKEN}, or "
            "leave it unset (no authentication: loopback only)"
        )
    size = len(token.encode("utf-8"))
    if size < MIN_TOKEN_BYTES:
        warnings.warn(
            f"{what} is only {size} bytes: anyone who sniffs one handshake can test guesses "
            f"offline (a 4-letter token was recovered in 0.2 s); use at least "
            f"{MIN_TOKEN_BYTES} random bytes, e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'",
            UserWarning,
            stacklevel=3,
        )


def read_token_file(path: str) -> str:
    """The token in file ``path``, its trailing newline stripped.

    :class:`ConfigError` naming the path when it is missing, unreadable, too large, not UTF-8
    or empty; a :class:`UserWarning` when group or others may read it.
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(TOKEN_FILE_LIMIT + 1)
    except OSError as exc:
        raise ConfigError(
            f"auth_token_file={path!r}: cannot read the token file: {exc.strerror or exc}"
        ) from None
    if len(raw) > TOKEN_FILE_LIMIT:
        raise ConfigError(f"auth_token_file={path!r}: over {TOKEN_FILE_LIMIT} bytes; a token "
                          "file holds one line, the token")
    try:
        token = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(f"auth_token_file={path!r}: the token is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"auth_token_file={path!r}: the file is empty; write the token in it")
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o077:
        warnings.warn(
            f"auth_token_file={path!r} may be read by other users (mode "
            f"{stat.S_IMODE(mode):o}); restrict it: chmod 600 {path}",
            UserWarning,
            stacklevel=3,
        )
    return token


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """The token to use: ``token``, or the one read from ``token_file``, checked.

    Both given: they must agree (:class:`ConfigError` otherwise, neither shown). The result
    passes :func:`check_token`.
    """
    if token_file is not None:
        from_file = read_token_file(token_file)
        if token is not None and token != from_file:
            raise ConfigError(
                f"auth_token and auth_token_file={token_file!r} give different tokens; give "
                "the token one way (BURNCOLL_AUTH_TOKEN or the file), not both"
            )
        token = from_file
    check_token(token)
    return token


def check_tls_mode(transport: str, tls: bool | None, paths: tuple[str | None, ...]) -> None:
    """Refuse ``tls`` settings that ``transport`` cannot honour (:class:`ConfigError`)."""
    if tls is False and transport == "quic":
        raise ConfigError("tls=false: QUIC always runs TLS; leave tls unset (automatic), or "
                          "choose transport websocket for plain ws")
    if tls is False and any(p is not None for p in paths):
        raise ConfigError("tls=false (plain ws) conflicts with the tls_cert/tls_key/tls_ca "
                          "paths given; remove them, or leave tls unset to use wss")
    if tls is True and transport == "tcp":
        raise ConfigError("tls=true: the tcp transport has no TLS; choose transport websocket "
                          "(wss) or quic, or leave tls unset")
