"""Strategies: pure functions from (world, root or owners) to a :class:`Schedule`.

Four families: :class:`Centralized`, :class:`Tree` (``arity``), :class:`Ring` and
:class:`Doubling` (the recursive-doubling all-reduce, between nodes only). They import
no threading, asyncio, transport or array library; the executors walk the schedules they make.
:func:`parse_strategy` turns a config spelling into a strategy.
"""

from __future__ import annotations

from burncoll.errors import ConfigError
from burncoll.strategies.auto import Auto, resolve
from burncoll.strategies.base import Strategy
from burncoll.strategies.by_host import ByHost
from burncoll.strategies.centralized import Centralized
from burncoll.strategies.doubling import Doubling
from burncoll.strategies.ring import Ring
from burncoll.strategies.schedule import Action, Schedule, Step
from burncoll.strategies.tree import Tree

__all__ = ["Action", "Auto", "ByHost", "Centralized", "Doubling", "Ring", "Schedule", "Step",
           "Strategy", "Tree", "parse_strategy", "resolve"]

_ACCEPTED = "'centralized', 'tree', 'tree:K' (K >= 1), 'ring', 'doubling' (global only), 'auto'"
#: The spellings without an argument (strategies are immutable values: one of each serves all).
_NAMED: dict[str, Strategy] = {"centralized": Centralized(), "ring": Ring(), "auto": Auto(),
                               "tree": Tree(2), "doubling": Doubling()}


def parse_strategy(value: Strategy | str) -> Strategy:
    """Return the strategy ``value`` names.

    A :class:`Strategy` is returned as is. Strings are stripped and case-insensitive:
    ``"centralized"``, ``"ring"``, ``"doubling"``, ``"tree"`` (= ``Tree(2)``) and ``"tree:K"``
    (= ``Tree(K)``, ``K`` a decimal integer ``>= 1``; blanks around the colon are allowed).

    Raises :class:`~burncoll.errors.ConfigError` for anything else; its message lists the
    accepted spellings (and says that the arity must be ``>= 1`` for ``"tree:0"``).
    """
    if isinstance(value, ByHost):
        raise ConfigError(
            "ByHost is not a strategy to configure: 'auto' composes by host where it pays, "
            f"from the hosts the nodes announce; name its inner strategy instead ({_ACCEPTED})")
    if isinstance(value, Strategy):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"strategy must be a Strategy or a string, got {type(value).__name__} {value!r}; "
            f"accepted: {_ACCEPTED}"
        )
    text = value.strip().lower()
    named = _NAMED.get(text)
    if named is not None:
        return named
    name, colon, arg = text.partition(":")
    if colon and name.strip() == "tree":
        arg = arg.strip()
        digits = arg[1:] if arg.startswith("-") else arg
        if digits.isascii() and digits.isdigit():
            arity = int(arg)
            if arity >= 1:
                return Tree(arity)
            raise ConfigError(
                f"unknown strategy {value!r}: the tree arity must be >= 1, got {arity}; "
                f"accepted: {_ACCEPTED}"
            )
    raise ConfigError(f"unknown strategy {value!r}; accepted: {_ACCEPTED}")
