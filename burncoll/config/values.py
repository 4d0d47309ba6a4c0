"""Reading config values: ``host:port`` addresses, strategy names, and the text of
``BURNCOLL_<FIELD>`` environment variables."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from burncoll.errors import ConfigError
from burncoll.hostlists import MAX_DIGITS, shown
from burncoll.strategies import Strategy, parse_strategy

__all__ = ["ENV_PREFIX", "MAX_NUM_DEVICES", "MAX_TIMEOUT", "check_timeout", "parse_env",
           "parse_host_port", "parse_strategy_field"]

#: The longest ``timeout``, in seconds (30 days): deadlines stay within what the clocks and
#: the waits of threads, sockets and event loops can hold.
MAX_TIMEOUT = 30 * 24 * 3600.0

#: The most local peers (``num_devices``) of one node: each is a thread of this process, and
#: a backend with real devices (CUDA) allows no more than it has.
MAX_NUM_DEVICES = 1024

#: Environment variables ``BURNCOLL_<FIELD>`` override config fields.
ENV_PREFIX = "BURNCOLL_"


def parse_host_port(value: str, field_name: str,
                    default_port: int | None = None) -> tuple[str, int]:
    """``"host:port"``, ``"ws://host:port/path"``, ``"quic://[::1]:5000"`` -> ``(host, port)``;
    a bare IPv6 address (``"fd00::2"``) is a host without a port."""
    text = value.strip()
    if text.count(":") > 1 and "[" not in text and "//" not in text:
        try:
            ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            pass
        else:
            if default_port is None:
                raise ConfigError(f"{field_name}={shown(value)}: the port is missing; use "
                                  f"'[{text}]:port'")
            return text, default_port
    split = urlsplit(text if "://" in text else "//" + text)
    try:
        port = split.port
    except ValueError as exc:
        raise ConfigError(f"{field_name}={shown(value)}: the port is not a number 0-65535") from exc
    host = split.hostname
    if not host:
        raise ConfigError(f"{field_name}={shown(value)}: expected 'host:port' or 'ws://host:port'")
    if port is None:
        if default_port is None:
            raise ConfigError(f"{field_name}={shown(value)}: the port is missing; use 'host:port'")
        port = default_port
    return host, port


def check_timeout(timeout: object) -> None:
    """A config's ``timeout``: a number of seconds, > 0 and at most :data:`MAX_TIMEOUT`
    (``inf`` is refused: every wait in burncoll has a deadline)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout <= MAX_TIMEOUT):
        raise ConfigError(f"timeout={timeout!r}: expected a number of seconds > 0 and at most "
                          f"{MAX_TIMEOUT:g} (30 days: every wait has a deadline, a finite one)")


def parse_strategy_field(name: str, value: object) -> Strategy:
    """A strategy field's value: a :class:`Strategy`, or its name (``"tree:3"``)."""
    if isinstance(value, str) and len(value) > 64:
        raise ConfigError(f"{name}={shown(value)}: not a strategy name; expected one of "
                          "'centralized', 'tree', 'tree:K', 'ring', 'doubling'")
    if isinstance(value, (Strategy, str)):
        try:
            strategy = parse_strategy(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if strategy.exchanges and name.startswith("local_"):
            raise ConfigError(
                f"{name}={strategy.spec!r}: the recursive doubling runs between nodes only (its "
                "rounds exchange chunks, which the threads of one node cannot); name it for a "
                "global_* strategy, and 'auto', 'centralized', 'tree', 'tree:K' or 'ring' here")
        return strategy
    raise ConfigError(f"{name}={shown(value)}: expected burncoll.Centralized(), Tree(k), Ring(), "
                      "burncoll.strategies.Doubling() or one of 'centralized', 'tree', "
                      "'tree:K', 'ring', 'doubling'")


def _parse_int(text: str) -> int:
    """An integer of at most :data:`~burncoll.hostlists.MAX_DIGITS` digits (``ValueError``
    otherwise, before any work that grows with the text)."""
    digits = text.strip()
    digits = digits[1:] if digits[:1] in ("+", "-") else digits  # one sign at most
    if not (digits.isascii() and digits.isdigit()) or len(digits) > MAX_DIGITS:
        raise ValueError(text)
    return int(text)


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "null") else _parse_int(text)


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
    "num_devices": _parse_int, "timeout": float,
    "max_object_containers": _parse_int,
    "auth_token": str,  # "" stays "": an empty token is refused, never read as "no token"
    **dict.fromkeys(("num_nodes", "data_service_port", "node_rank"), _parse_optional_int),
    **dict.fromkeys(("global_address", "node_address", "auth_token_file", "compression",
                     "tls_cert", "tls_key", "tls_ca"), _parse_optional_str),
    **dict.fromkeys(("insecure", "integrity", "shared_memory", "caller_sockets"), _parse_bool),
    **dict.fromkeys(("tls", "host_orchestrator"), _parse_optional_bool),
}


#: What each parser accepts, as its error says.
_ACCEPTS: dict[Callable[[str], Any], str] = {
    _parse_int: f"an integer of at most {MAX_DIGITS} digits",
    _parse_optional_int: f"an integer of at most {MAX_DIGITS} digits, or none",
    float: "a number of seconds",
    _parse_bool: "true or false (also 1/0, yes/no, on/off)",
    _parse_optional_bool: "true, false or auto (also 1/0, yes/no, on/off)",
}


def parse_env(name: str, raw: str) -> Any:
    """The value of environment variable ``BURNCOLL_<NAME>`` for config field ``name``:
    :class:`ConfigError` naming the variable (its value shortened) when it is not one."""
    parser = _ENV_PARSERS.get(name, str)
    try:
        value = parser(raw)
    except ValueError:
        raise ConfigError(f"environment variable {ENV_PREFIX}{name.upper()}={shown(raw)} is not "
                          f"a valid {name}: expected {_ACCEPTS.get(parser, 'a ' + name)}"
                          ) from None
    if name == "num_devices" and not 1 <= value <= MAX_NUM_DEVICES:
        raise ConfigError(f"environment variable {ENV_PREFIX}NUM_DEVICES={value}: expected 1 to "
                          f"{MAX_NUM_DEVICES} local peers (one thread each); set it to the "
                          "devices this node uses")
    return value
