"""A symbolic simulator for :class:`~burncoll.strategies.Schedule` s.

Each participant holds, per chunk, a :class:`Value`: a :class:`collections.Counter` of the
participants whose data it contains (REDUCE adds counters, COPY replaces), plus the expression
tree of the reduction (``int`` leaf = a participant's original data, ``(acc, incoming)`` = a
REDUCE step) so tests can check that a chunk's reduction was computed once and then copied.
``None`` marks a chunk that holds nothing meaningful yet (reading it is a bug).

:func:`play` executes a schedule round by round, reading values as of the start of the round,
and *asserts* the schedule invariants independently of ``burncoll.strategies._checks``:
indices in range, ``src != dst``, no (participant, chunk) both read and written in one round,
no COPY target written twice in one round, no read of an empty chunk, no REDUCE into one.
It also counts rounds and the bytes each participant sends and receives for an array of
``size`` bytes split into ``num_chunks`` equal chunks. ``exchanges=True`` plays an exchange
schedule (:class:`~burncoll.strategies.Doubling`): a REDUCE may then write a chunk its
participant sends in the same round (every step reads the start-of-round value).

:func:`tally` only counts (no values: a schedule of 1,024 participants in seconds): per round
the busiest participant's messages and bytes (sent plus received) and bytes reduced, and the
totals -- what :func:`burncoll.strategies.cost.cost` predicts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

from burncoll.strategies import Action, Schedule
from burncoll.strategies.cost import Cost, RoundCost

Expr = Union[int, tuple["Expr", "Expr"]]  # noqa: UP007 (recursive alias needs a string ref)


@dataclass(frozen=True)
class Value:
    """Contents of one chunk at one participant. Treated as immutable (shared by COPY)."""

    counts: Counter[int]
    expr: Expr

    def reduce(self, incoming: Value) -> Value:
        """``self (op) incoming``: the destination's value combined with the received one."""
        return Value(self.counts + incoming.counts, (self.expr, incoming.expr))


def leaf(participant: int) -> Value:
    """The original data of ``participant``."""
    return Value(Counter({participant: 1}), participant)


State = list[list[Value | None]]


def own_data(world: int, num_chunks: int) -> State:
    """Every participant holds its own data in every chunk (reduce, all-reduce, ...)."""
    return [[leaf(p) for _ in range(num_chunks)] for p in range(world)]


def only_root(world: int, num_chunks: int, root: int) -> State:
    """Only ``root`` holds data (broadcast); everyone else holds nothing."""
    return [[leaf(p) if p == root else None for _ in range(num_chunks)] for p in range(world)]


def only_owners(world: int, owners: tuple[int, ...]) -> State:
    """Participant ``owners[c]`` alone holds chunk ``c`` (all-gather)."""
    return [[leaf(p) if o == p else None for o in owners] for p in range(world)]


def full(world: int) -> Counter[int]:
    """The content of a chunk reduced over all participants, each exactly once."""
    return Counter(range(world))


@dataclass
class Result:
    """The final state and the cost of a played schedule."""

    state: State
    rounds: int
    bytes_sent: list[Fraction]
    bytes_received: list[Fraction]
    max_fan_in: int  # most messages one participant received in one round


class ScheduleViolation(AssertionError):
    """The schedule broke an invariant of :mod:`burncoll.strategies.schedule`."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ScheduleViolation(msg)


def play(schedule: Schedule, state: State, *, size: int = 1 << 20,
         exchanges: bool = False) -> Result:
    """Run ``schedule`` on ``state`` (modified in place) and return the result and costs."""
    world, nc = schedule.world, schedule.num_chunks
    _check(len(state) == world, f"state has {len(state)} participants, schedule {world}")
    _check(all(len(row) == nc for row in state), "state rows must have num_chunks chunks")
    chunk_bytes = Fraction(size, nc) if nc else Fraction(0)
    sent = [Fraction(0)] * world
    received = [Fraction(0)] * world
    max_fan_in = 0
    for r, rnd in enumerate(schedule.rounds):
        reads: set[tuple[int, int]] = set()
        writes: Counter[tuple[int, int]] = Counter()
        copies: set[tuple[int, int]] = set()
        fan_in: Counter[int] = Counter()
        for s in rnd:
            where = f"round {r} step {s}"
            _check(0 <= s.src < world and 0 <= s.dst < world, f"{where}: participant range")
            _check(s.src != s.dst, f"{where}: src == dst")
            _check(0 <= s.chunk < nc, f"{where}: chunk out of range")
            _check(s.action in (Action.REDUCE, Action.COPY), f"{where}: bad action")
            reads.add((s.src, s.chunk))
            writes[(s.dst, s.chunk)] += 1
            fan_in[s.dst] += 1
            if s.action is Action.COPY:
                copies.add((s.dst, s.chunk))
        both = reads & set(writes)
        if exchanges:
            both -= {(s.dst, s.chunk) for s in rnd if s.action is Action.REDUCE}
        _check(not both, f"round {r}: read and written in one round: {sorted(both)}")
        twice = [k for k in copies if writes[k] > 1]
        _check(not twice, f"round {r}: COPY target written twice: {twice}")
        max_fan_in = max([max_fan_in, *fan_in.values()])
        # Every step reads the value the round found.
        incoming = [state[s.src][s.chunk] for s in rnd]
        for s, val in zip(rnd, incoming, strict=True):
            _check(val is not None, f"round {r} step {s}: reads a chunk that holds nothing")
            assert val is not None
            if s.action is Action.COPY:
                state[s.dst][s.chunk] = val
            else:
                cur = state[s.dst][s.chunk]
                _check(cur is not None, f"round {r} step {s}: REDUCE into an empty chunk")
                assert cur is not None
                state[s.dst][s.chunk] = cur.reduce(val)
            sent[s.src] += chunk_bytes
            received[s.dst] += chunk_bytes
    return Result(state, len(schedule.rounds), sent, received, max_fan_in)


def tally(schedule: Schedule, size: int) -> Cost:
    """What ``schedule`` moves for an array of ``size`` bytes, counted step by step."""
    chunk = Fraction(size, schedule.num_chunks) if schedule.num_chunks else Fraction(0)
    rounds = []
    for rnd in schedule.rounds:
        messages = Counter(s.src for s in rnd)
        messages.update(s.dst for s in rnd)
        reduced = Counter(s.dst for s in rnd if s.action is Action.REDUCE)
        busiest = max(messages.values())
        rounds.append(RoundCost(busiest, busiest * chunk, max(reduced.values(), default=0) * chunk))
    steps = sum(map(len, schedule.rounds))
    reducing = sum(s.action is Action.REDUCE for rnd in schedule.rounds for s in rnd)
    return Cost(tuple(rounds), steps, steps * chunk, reducing * chunk)
