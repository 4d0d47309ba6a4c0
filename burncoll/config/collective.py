"""``CollectiveConfig``: one frozen dataclass describing a collective, validated on creation.

Where each field's value comes from is :mod:`burncoll.config.sources`. Secure by default: a
multi-node config whose ``node_address`` is not loopback needs an ``auth_token`` (or
``auth_token_file``) unless ``insecure``; an empty token is refused, one shorter than
:data:`MIN_TOKEN_BYTES` bytes warns. ``repr`` and :meth:`~CollectiveConfig.to_dict` never show
the token.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from burncoll.backends import BACKEND_NAMES
from burncoll.compression import COMPRESSIONS
from burncoll.config.names import nearest, refuse_unknown_names
from burncoll.config.security import (
    HOW_TO_SET_A_TOKEN,
    check_bind_address,
    check_tls_mode,
    resolve_token,
)
from burncoll.config.sources import check_node_fields, file_values, naming_the_variable, resolve
from burncoll.config.values import MAX_NUM_DEVICES, parse_host_port, parse_strategy_field
from burncoll.config.values import check_timeout as check_timeout_field
from burncoll.errors import ConfigError
from burncoll.hostlists import shown
from burncoll.strategies import Auto, Strategy
from burncoll.transport import TRANSPORT_NAMES
from burncoll.transport.base import TlsSettings

__all__ = ["CollectiveConfig"]

#: What :func:`repr` and :meth:`CollectiveConfig.to_dict` show instead of a token.
REDACTED = "***"
_STRATEGY_FIELDS = ("local_all_reduce_strategy", "local_reduce_strategy",
                    "local_broadcast_strategy", "global_all_reduce_strategy",
                    "global_reduce_strategy", "global_broadcast_strategy")


@dataclass(frozen=True)
class CollectiveConfig:
    """How a collective is laid out, which algorithms it uses, and how nodes talk.

    Build it with keywords, ``with_<field>(value)`` builders, :meth:`from_yaml`, or
    ``BURNCOLL_<FIELD>`` environment variables and launcher variables for the fields not
    given; first match wins: the code, a variable, a YAML file, the launcher, the default
    (:mod:`burncoll.config.sources`). Invalid values raise :class:`~burncoll.ConfigError`
    naming the field (the ``BURNCOLL_*`` variable, for a variable's value) and what it accepts.
    """

    #: Array library: ``"numpy"`` (CPU), ``"jax"``, ``"cupy"`` or ``"torch"`` (tensors).
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
    #: This node's rank, ``0 .. num_nodes - 1``; :func:`burncoll.peer_ids` numbers its peers
    #: ``node_rank * num_devices + i``. ``None``: from the launcher's variables, else 0.
    node_rank: int | None = None
    #: Node 0 runs the orchestrator inside its process, listening on ``global_address`` (as
    #: torch's rank 0 hosts its TCPStore); other nodes ignore it. ``None`` (automatic): yes in
    #: a job started by torchrun, SLURM or mpirun unless the code set ``global_address``;
    #: ``burncoll launch`` runs its own.
    host_orchestrator: bool | None = None
    #: Set by :meth:`~burncoll.Communicator.split` and :meth:`~burncoll.Communicator.group`;
    #: leave it ``None``. It names a communicator group's collective, so that a group's peers
    #: register apart from the parent's and from other groups' on the same node.
    group: str | None = None
    #: Send float32/float64 all-reduces between nodes as 16-bit values: ``"bf16"`` or
    #: ``"fp16"`` (sums still accumulate in the input's precision; error bound in
    #: :mod:`burncoll.compression`). ``None``: full precision. Other dtypes, and a single node,
    #: are never compressed; ``all_reduce(..., compression=)`` overrides it per call.
    compression: str | None = None
    #: Node processes of one host exchange large messages through shared memory
    #: (:mod:`burncoll.transport.shm`; chosen automatically, never between hosts). ``False``:
    #: always through the transport.
    shared_memory: bool = True
    #: Small operations between nodes (the one-round exchange) are sent and received by the
    #: calling thread on a socket of its own per node pair (:mod:`burncoll.node.lanes`), not
    #: through the event loop; tcp and plain websocket only (not with TLS or ``integrity``).
    #: Used only when every node has it on.
    caller_sockets: bool = True
    #: How many containers (lists, tuples, dicts) and dict entries an object received from a
    #: peer may hold (``all_gather_object`` and the other object collectives); a record of
    #: more than 16 bytes per container may hold one per 16 bytes. More is refused before it
    #: is decoded (:mod:`burncoll.comm.object_scan`), with a ``ProtocolError`` naming the peer.
    max_object_containers: int = 2**19

    def __new__(cls, *args: Any, **kwargs: Any) -> CollectiveConfig:
        """Remember which fields the caller gave: those win over every environment variable."""
        self = super().__new__(cls)
        refuse_unknown_names(kwargs, (f.name for f in fields(cls)), "CollectiveConfig(...)")
        given = [f.name for f in fields(cls)][: len(args)] + list(kwargs)
        object.__setattr__(self, "_given", frozenset(given))
        return self

    def __post_init__(self) -> None:
        code: frozenset[str] = getattr(self, "_given", frozenset())
        so_far = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in resolve(code, so_far).items():  # the environment, the launcher
            object.__setattr__(self, name, value)
        try:
            for name in _STRATEGY_FIELDS:
                object.__setattr__(self, name, parse_strategy_field(name, getattr(self, name)))
            _validate(self)
        except ConfigError as exc:
            raise naming_the_variable(exc, code) from None

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

    @property
    def uses_lanes(self) -> bool:
        """Whether this node offers caller sockets (``caller_sockets`` on a transport that
        sends plain bytes: tcp, or websocket without TLS, and no integrity tags)."""
        return self.caller_sockets and self.transport in ("tcp", "websocket") and not (
            self.uses_tls or self.integrity)

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
        return {"num_nodes": self.num_nodes,
                **{name: self.strategy(name).spec for name in _STRATEGY_FIELDS[3:]},  # global
                "transport": self.transport, "integrity": self.integrity, "tls": self.uses_tls}

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
        """Read a YAML mapping whose keys are field names; ``BURNCOLL_<FIELD>`` variables
        override the file's values (and the file overrides the launcher's variables)."""
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
        try:
            return cls.from_mapping(file_values(data), source=str(path))
        except ConfigError as exc:
            raise ConfigError(f"{exc}{_text_for_number(data, str(exc))}") from None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "mapping") -> CollectiveConfig:
        """Build from a mapping of field names to values; unknown keys are an error."""
        refuse_unknown_names(data, (f.name for f in fields(cls)), source)
        return cls(**{str(k): v for k, v in data.items()})

    def replace(self, **changes: Any) -> CollectiveConfig:
        """A copy with ``changes`` applied (validated again): the fields the code gave, with
        ``changes``; the others are found again from the environment and the launcher, so a
        derived value (the routed ``node_address``, ``host_orchestrator``) follows the change.
        """
        given: frozenset[str] = getattr(self, "_given", frozenset())
        kept = {name: getattr(self, name) for name in given if name not in changes}
        return type(self)(**kept, **changes)

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

    def with_tls(self, cert: str | None, key: str | None,
                 ca: str | None = None) -> CollectiveConfig:
        return self.replace(tls_cert=cert, tls_key=key, tls_ca=ca)


# -- validation --------------------------------------------------------------------------


def _require_int(cfg: CollectiveConfig, name: str, minimum: int, optional: bool) -> None:
    value = getattr(cfg, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={shown(value)}: expected an integer >= {minimum}")


def _validate(cfg: CollectiveConfig) -> None:
    for name, names in (("backend", BACKEND_NAMES), ("transport", TRANSPORT_NAMES)):
        value = getattr(cfg, name)
        if value not in names:
            raise ConfigError(f"{name}={shown(value)}: expected one of {', '.join(names)}"
                              f"{nearest(str(value), names)}")
    _require_int(cfg, "num_devices", 1, optional=False)
    if cfg.num_devices > MAX_NUM_DEVICES:
        raise ConfigError(f"num_devices={cfg.num_devices}: expected at most {MAX_NUM_DEVICES} "
                          "local peers (one thread each)")
    _require_int(cfg, "max_object_containers", 1, optional=False)
    _require_int(cfg, "num_nodes", 1, optional=True)
    _require_int(cfg, "data_service_port", 0, optional=True)
    if cfg.data_service_port is not None and cfg.data_service_port > 65535:
        raise ConfigError(f"data_service_port={cfg.data_service_port}: expected 0-65535")
    check_timeout_field(cfg.timeout)
    for name in ("auth_token", "auth_token_file", "tls_cert", "tls_key", "tls_ca",
                 "global_address", "node_address", "group"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            text = REDACTED if name == "auth_token" else shown(value)
            raise ConfigError(f"{name}={text}: expected a string or None")
    for name in ("insecure", "integrity", "shared_memory", "caller_sockets"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={shown(getattr(cfg, name))}: expected true or false")
    if isinstance(cfg.compression, str) and cfg.compression.strip().lower() in ("none", ""):
        object.__setattr__(cfg, "compression", None)  # YAML ``compression: none``
    if cfg.compression is not None and cfg.compression not in COMPRESSIONS:
        raise ConfigError(f"compression={shown(cfg.compression)}: expected one of "
                          f"{', '.join(COMPRESSIONS)} or none")
    if isinstance(cfg.tls, str) and cfg.tls.strip().lower() == "auto":
        object.__setattr__(cfg, "tls", None)  # YAML ``tls: auto``, as BURNCOLL_TLS=auto
    if cfg.tls is not None and not isinstance(cfg.tls, bool):
        raise ConfigError(f"tls={shown(cfg.tls)}: expected true, false or auto (null)")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("tls_cert and tls_key must be given together (PEM file paths)")
    check_tls_mode(cfg.transport, cfg.tls, (cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    object.__setattr__(cfg, "auth_token", resolve_token(cfg.auth_token, cfg.auth_token_file))
    if cfg.integrity and cfg.auth_token is None and cfg.is_multi_node:
        warnings.warn(
            "integrity: true without an auth_token protects little: the connections to the "
            "orchestrator then have no key, and the session secret that keys the connections "
            "between nodes travels over them; " + HOW_TO_SET_A_TOKEN,
            UserWarning, stacklevel=4)
    found = check_node_fields(cfg.num_nodes, cfg.node_rank, cfg.host_orchestrator,
                              cfg.global_address, cfg.node_address)
    if found is not None:
        object.__setattr__(cfg, "node_address", found)
    if cfg.node_address is not None:
        host, _ = parse_host_port(cfg.node_address, "node_address", default_port=0)
        if cfg.is_multi_node:
            what = f"node_address={host!r}" + (
                " (found: this machine's address toward the rendezvous host)" if found else "")
            check_bind_address(host, cfg.auth_token, cfg.insecure, what,
                               "insecure: true (BURNCOLL_INSECURE=1)")


def _text_for_number(data: Mapping[Any, Any], error: str) -> str:
    """A hint for a refused YAML value that is a number written as text (``"30"`` quoted,
    or ``1e2``, which YAML 1.1 reads as a string), or ``""``."""
    for key, value in data.items():
        if isinstance(value, str) and error.startswith(f"{key}="):
            try:
                number = float(value)
            except ValueError:
                return ""
            if not math.isfinite(number) or "expected a" not in error:
                return ""
            plain = int(number) if number.is_integer() else number
            return (f". The YAML file gives {key} as the text {value!r}, not a number (YAML "
                    f"reads quoted values and exponents without a dot, such as 1e2, as text): "
                    f"write {key}: {plain}")
    return ""

