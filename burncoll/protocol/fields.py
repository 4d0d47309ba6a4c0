"""Reading the fields of a JSON message with every type and range checked.

The control messages (:mod:`burncoll.protocol.control`) come from other processes, some of which
may be strangers: a field is used only once it is known to be what the message type says.
:class:`Fields` notes every field that is not, so that one error names them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TypeAlias, TypeVar

from burncoll.errors import ProtocolError

__all__ = ["Fields", "JsonObject", "JsonValue", "MalformedMessage", "canonical", "count",
           "int_tuple", "is_int"]

JsonValue: TypeAlias = "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = "dict[str, JsonValue]"
T = TypeVar("T")

#: Longest decimal spelling of an int key (a u64 has 20 digits); longer ones are refused
#: before ``int()`` is asked to read them.
_KEY_DIGITS = 20


class MalformedMessage(ProtocolError):
    """A control message whose fields are not what its type says."""


def is_int(value: object, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high]``."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def count(value: object) -> int | None:
    """``value`` if it is an int >= 0, else ``None``."""
    return value if isinstance(value, int) and is_int(value, 0) else None


def int_tuple(value: object, highest: int) -> tuple[int, ...] | None:
    """``value`` as a tuple if it is a list of ints in ``[0, highest]``, else ``None``."""
    if isinstance(value, list) and all(is_int(v, 0, highest) for v in value):
        return tuple(value)
    return None


def canonical(value: object) -> str:
    """The canonical JSON spelling of ``value`` (sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _index(key: object) -> int | None:
    """A key of an object by int: an int >= 0, or its decimal spelling (as JSON has it)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= _KEY_DIGITS:
        return int(key)
    return key if isinstance(key, int) and is_int(key, 0) else None


class Fields:
    """Reads the fields of one message, noting each that is wrong; :meth:`check` raises
    :class:`MalformedMessage` naming them all (what was read meanwhile is a placeholder). ``what``
    names the message in the error (``"join message"``); ``prefix`` each field (``"nodes[2]."``, for
    an object within the message)."""

    def __init__(self, message: Mapping[str, object], what: str, prefix: str = "") -> None:
        self.message = message
        self.what = what
        self.prefix = prefix
        self.problems: list[str] = []

    def problem(self, text: str) -> None:
        self.problems.append(self.prefix + text)

    def check(self) -> None:
        if self.problems:
            raise MalformedMessage(f"malformed {self.what}: {'; '.join(self.problems)}")

    def integer(self, key: str, low: int, high: int | None = None) -> int:
        value = self.message.get(key)
        if isinstance(value, int) and is_int(value, low, high):
            return value
        self.problem(f"{key} must be an int in [{low}, {high}]" if high is not None
                     else f"{key} must be an int >= {low}")
        return low

    def text(self, key: str, most: int | None = None) -> str:
        """A string; with ``most``, a non-empty one of at most ``most`` characters."""
        value = self.message.get(key)
        if isinstance(value, str) and (most is None or 0 < len(value) <= most):
            return value
        self.problem(f"{key} must be a string" if most is None else
                     f"{key} must be a non-empty string of at most {most} characters")
        return ""

    def ids(self, key: str, most: int, highest: int) -> tuple[int, ...]:
        """A non-empty list of at most ``most`` distinct ints in ``[0, highest]``."""
        value = self.message.get(key)
        if isinstance(value, list) and 0 < len(value) <= most and all(
                is_int(p, 0, highest) for p in value) and len(set(value)) == len(value):
            return tuple(value)
        self.problem(f"{key} must be a non-empty list of at most {most} distinct ints >= 0")
        return ()

    def json_object(self, key: str, most_bytes: int, *, optional: bool = False) -> JsonObject:
        """An object of at most ``most_bytes`` of canonical JSON. ``optional``: a value that is
        not an object is dropped (``{}``), not refused."""
        value = self.message.get(key)
        if not isinstance(value, dict):
            if not optional:
                self.problem(f"{key} must be an object")
            return {}
        if len(canonical(value)) > most_bytes:
            self.problem(f"{key} must be at most {most_bytes} bytes of JSON")
        return value

    def int_map(self, key: str, value: Callable[[object], T | None], what: str
                ) -> dict[int, T] | None:
        """An optional object whose keys are ints >= 0 (decimal strings in JSON) and whose
        values ``value`` converts (to ``None`` when one is not ``what``); ``None`` when
        absent."""
        found = self.message.get(key)
        if found is None:
            return None
        if isinstance(found, dict):
            pairs = [(_index(k), value(v)) for k, v in found.items()]
            entries = {k: v for k, v in pairs if k is not None and v is not None}
            if len(entries) == len(pairs):
                return entries
        self.problem(f"{key} must be an object of {what} by int key")
        return None
