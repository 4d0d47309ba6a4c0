"""The simulator itself: it plays valid schedules and rejects broken ones."""

from __future__ import annotations

from collections import Counter

import pytest

from burncoll.strategies import Action, Schedule, Step
from burncoll.strategies._checks import validate_schedule

from .simulator import ScheduleViolation, full, only_owners, only_root, own_data, play

R, C = Action.REDUCE, Action.COPY


def test_plays_a_hand_written_all_reduce() -> None:
    sched = Schedule(3, 1, ((Step(1, 0, 0, R), Step(2, 0, 0, R)), (Step(0, 1, 0, C),)))
    res = play(sched, own_data(3, 1), size=12)
    assert res.rounds == 2
    assert res.state[0][0] is not None and res.state[0][0].counts == full(3)
    assert res.state[0][0].expr == ((0, 1), 2)  # reduced in the order listed
    assert res.state[1][0] == res.state[0][0]
    assert res.bytes_sent == [12, 12, 12]
    assert res.bytes_received == [24, 12, 0]
    assert res.max_fan_in == 2


BROKEN = {
    "read and written": Schedule(3, 1, ((Step(0, 1, 0, R), Step(1, 2, 0, R)),)),
    "src == dst": Schedule(2, 1, ((Step(1, 1, 0, C),),)),
    "participant out of range": Schedule(2, 1, ((Step(0, 2, 0, C),),)),
    "negative participant": Schedule(2, 1, ((Step(-1, 0, 0, C),),)),
    "chunk out of range": Schedule(2, 1, ((Step(0, 1, 1, C),),)),
    "copy target twice": Schedule(3, 1, ((Step(0, 2, 0, C), Step(1, 2, 0, C)),)),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_rejects_broken_schedules(name: str) -> None:
    sched = BROKEN[name]
    with pytest.raises(ScheduleViolation):
        play(sched, own_data(sched.world, sched.num_chunks))
    with pytest.raises(ValueError):
        validate_schedule(sched)


def test_rejects_reading_an_empty_chunk() -> None:
    # Participant 1 forwards before it received anything from root 0.
    sched = Schedule(3, 1, ((Step(1, 2, 0, C),), (Step(0, 1, 0, C),)))
    validate_schedule(sched)  # structurally fine, semantically wrong
    with pytest.raises(ScheduleViolation, match="holds nothing"):
        play(sched, only_root(3, 1, 0))


def test_rejects_reduce_into_an_empty_chunk() -> None:
    sched = Schedule(2, 1, ((Step(0, 1, 0, R),),))
    with pytest.raises(ScheduleViolation, match="REDUCE into"):
        play(sched, only_root(2, 1, 0))


def test_only_owners_state() -> None:
    state = only_owners(3, (2, 0, 2))
    assert [[v is not None for v in row] for row in state] == [
        [False, True, False],
        [False, False, False],
        [True, False, True],
    ]
    assert state[2][0] is not None and state[2][0].counts == Counter({2: 1})


def test_reduce_many_into_one_in_one_round_is_fine() -> None:
    sched = Schedule(4, 2, ((Step(1, 0, 0, R), Step(2, 0, 0, R), Step(3, 0, 1, R)),))
    validate_schedule(sched)
    res = play(sched, own_data(4, 2))
    assert res.state[0][0] is not None and res.state[0][0].counts == Counter({0: 1, 1: 1, 2: 1})
