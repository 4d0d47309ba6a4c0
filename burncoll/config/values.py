"""Reading config values: ``host:port`` addresses, strategy names, and the text of
``BURNCOLL_<FIELD>`` environment variables."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from burncoll.errors import ConfigError
from burncoll.strategies import Strategy, parse_strategy

__all__ = ["ENV_PREFIX", "MAX_TIMEOUT", "check_timeout", "parse_env", "parse_host_port",
           "parse_strategy_field"]

#: The longest ``timeout``, in seconds (30 days): deadlines stay within what the clocks and
#: the waits of threads, sockets and event loops can hold.
MAX_TIMEOUT = 30 * 24 * 3600.0

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
                raise ConfigError(f"{field_name}={value!r}: the port is missing; use "
                                  f"'[{text}]:port'")
            return text, default_port
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


def check_timeout(timeout: object) -> None:
    """A config's ``timeout``: a number of seconds, > 0 and at most :data:`MAX_TIMEOUT`
    (``inf`` is refused: every wait in burncoll has a deadline)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout <= MAX_TIMEOUT):
        raise ConfigError(f"timeout={timeout!r}: expected a number of seconds > 0 and at most "
                          f"{MAX_TIMEOUT:g} (30 days: every wait has a deadline, a finite one)")


def parse_strategy_field(name: str, value: object) -> Strategy:
    """A strategy field's value: a :class:`Strategy`, or its name (``"tree:3"``)."""
    if isinstance(value, (Strategy, str)):
        try:
            return parse_strategy(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    raise ConfigError(f"{name}={value!r}: expected burncoll.Centralized(), Tree(k), Ring() or "
                      "one of 'centralized', 'tree', 'tree:K', 'ring'")


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
    "num_devices": int, "timeout": float,
    "max_object_containers": int,
    "auth_token": str,  # "" stays "": an empty token is refused, never read as "no token"
    **dict.fromkeys(("num_nodes", "data_service_port", "node_rank"), _parse_optional_int),
    **dict.fromkeys(("global_address", "node_address", "auth_token_file", "compression",
                     "tls_cert", "tls_key", "tls_ca"), _parse_optional_str),
    **dict.fromkeys(("insecure", "integrity", "shared_memory", "caller_sockets"), _parse_bool),
    **dict.fromkeys(("tls", "host_orchestrator"), _parse_optional_bool),
}


#: What each parser accepts, as its error says.
_ACCEPTS: dict[Callable[[str], Any], str] = {
    int: "an integer",
    _parse_optional_int: "an integer, or none",
    float: "a number of seconds",
    _parse_bool: "true or false (also 1/0, yes/no, on/off)",
    _parse_optional_bool: "true, false or auto (also 1/0, yes/no, on/off)",
}


def parse_env(name: str, raw: str) -> Any:
    """The value of environment variable ``BURNCOLL_<NAME>`` for config field ``name``."""
    parser = _ENV_PARSERS.get(name, str)
    try:
        return parser(raw)
    except ValueError:
        raise ConfigError(f"environment variable {ENV_PREFIX}{name.upper()}={raw!r} is not a "
                          f"valid {name}: expected {_ACCEPTS.get(parser, 'a ' + name)}") from None
