"""The strategy interface: a pure function from (world, root) to a :class:`Schedule`.

Strategies import no threading, asyncio, transport or array library; the local executor
(threads and backend ops) and the global executor (the network) walk the same schedules.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from burncoll.strategies.schedule import Schedule

__all__ = ["Strategy", "cached_schedules", "default_owners"]

S = TypeVar("S", bound="Strategy")
_CACHE_SIZE = 1024


def default_owners(world: int) -> tuple[int, ...]:
    """One chunk per participant, chunk ``i`` owned by participant ``i``."""
    return tuple(range(world))


class Strategy(abc.ABC):
    """A family of schedules. Implementations are immutable, hashable value objects.

    Every method returns a valid schedule (see :mod:`burncoll.strategies.schedule`) for any
    ``world >= 1`` and any ``0 <= root < world``. Results are cached by the caller.
    """

    @property
    def exchanges(self) -> bool:
        """Whether a round of its schedules may send a (participant, chunk) and reduce into it
        (:class:`~burncoll.strategies.doubling.Doubling`): only the node walk, which sends a
        round's chunks before it receives, runs those; the threads of one node do not."""
        return False

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The config spelling: ``"centralized"``, ``"tree:3"``, ``"ring"``."""

    @abc.abstractmethod
    def reduce(self, world: int, root: int) -> Schedule:
        """After it, ``root`` holds every chunk reduced over all participants."""

    @abc.abstractmethod
    def broadcast(self, world: int, root: int) -> Schedule:
        """After it, every participant holds ``root``'s chunks (copied, never reduced)."""

    @abc.abstractmethod
    def all_reduce(self, world: int) -> Schedule:
        """After it, every participant holds every chunk reduced over all participants.

        Each chunk's reduction is computed once and then copied, so all participants end
        with bitwise-identical chunks.
        """

    @abc.abstractmethod
    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        """``len(owners)`` chunks; after it, participant ``owners[c]`` holds chunk ``c``
        reduced over all participants (what others hold is unspecified)."""

    @abc.abstractmethod
    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        """``len(owners)`` chunks; at the start only participant ``owners[c]`` holds chunk
        ``c``; after it, every participant holds every chunk (copied, never reduced)."""


def cached_schedules(cls: type[S]) -> type[S]:
    """Cache the five schedules of ``cls`` by strategy and arguments (strategies are
    immutable, hashable values; ``owners`` is cached as a tuple)."""
    for name in ("reduce", "broadcast", "all_reduce", "reduce_scatter", "all_gather"):
        setattr(cls, name, _cached(getattr(cls, name)))
    return cls


def _cached(method: Callable[..., Schedule]) -> Callable[..., Schedule]:
    cached = functools.lru_cache(maxsize=_CACHE_SIZE)(method)

    @functools.wraps(method)
    def schedule(self: Strategy, *args: Any) -> Schedule:
        return cached(self, *(a if isinstance(a, Hashable) else tuple(a) for a in args))
    return schedule
