"""Argument checks shared by the strategies, and a validator for :class:`Schedule` s.

Everything here raises :class:`ValueError` (a programming error of the caller: the config and
API layers validate user input before a strategy sees it). Pure and stdlib-only, like the rest
of :mod:`burncoll.strategies`.
"""

from __future__ import annotations

from burncoll.strategies.schedule import Action, Round, Schedule

__all__ = ["check_owners", "check_root", "check_world", "drop_empty", "validate_schedule"]


def check_world(world: int) -> None:
    """Raise :class:`ValueError` unless ``world`` is an integer ``>= 1``."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an integer >= 1, got {world!r}")


def check_root(world: int, root: int) -> None:
    """Raise :class:`ValueError` unless ``world >= 1`` and ``0 <= root < world``."""
    check_world(world)
    if not isinstance(root, int) or not 0 <= root < world:
        raise ValueError(f"root must be an integer in [0, {world}), got {root!r}")


def check_owners(world: int, owners: tuple[int, ...]) -> tuple[int, ...]:
    """Return ``owners`` as a tuple; raise :class:`ValueError` if an owner is out of range."""
    check_world(world)
    owners = tuple(owners)
    for c, o in enumerate(owners):
        if not isinstance(o, int) or not 0 <= o < world:
            raise ValueError(f"owners[{c}] must be an integer in [0, {world}), got {o!r}")
    return owners


def drop_empty(rounds: list[Round]) -> tuple[Round, ...]:
    """``rounds`` without its empty rounds, as a tuple."""
    return tuple(r for r in rounds if r)


def validate_schedule(schedule: Schedule, exchanges: bool = False) -> None:
    """Raise :class:`ValueError` if ``schedule`` breaks the contract of
    :mod:`burncoll.strategies.schedule`. Checked per step: ``src`` and ``dst`` in ``[0, world)``,
    ``src != dst``, ``chunk`` in ``[0, num_chunks)``, ``action`` an :class:`Action`. Checked per
    round: no (participant, chunk) is both read and written, and a (participant, chunk) written by a
    ``COPY`` is written by no other step of the round. ``exchanges`` (a schedule of a strategy
    whose :attr:`~burncoll.strategies.Strategy.exchanges` is true) allows a REDUCE into a
    (participant, chunk) that the participant sends in the same round."""
    check_world(schedule.world)
    if schedule.num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {schedule.num_chunks}")
    for r, rnd in enumerate(schedule.rounds):
        reads: set[tuple[int, int]] = set()
        writes: dict[tuple[int, int], int] = {}
        copies: set[tuple[int, int]] = set()
        reduces: set[tuple[int, int]] = set()
        for s in rnd:
            where = f"round {r}, step {s}"
            if not (0 <= s.src < schedule.world and 0 <= s.dst < schedule.world):
                raise ValueError(f"{where}: participant out of range [0, {schedule.world})")
            if s.src == s.dst:
                raise ValueError(f"{where}: src == dst")
            if not 0 <= s.chunk < schedule.num_chunks:
                raise ValueError(f"{where}: chunk out of range [0, {schedule.num_chunks})")
            if not isinstance(s.action, Action):
                raise ValueError(f"{where}: action is not an Action")
            reads.add((s.src, s.chunk))
            key = (s.dst, s.chunk)
            writes[key] = writes.get(key, 0) + 1
            (copies if s.action is Action.COPY else reduces).add(key)
        both = reads & writes.keys()
        if exchanges:
            both -= reduces
        if both:
            raise ValueError(f"round {r}: (participant, chunk) read and written: {sorted(both)}")
        clobbered = sorted(k for k in copies if writes[k] > 1)
        if clobbered:
            raise ValueError(f"round {r}: COPY target written more than once: {clobbered}")
