from __future__ import annotations

import json

import pytest

from pipetrain.schedule import (
    Costs,
    ScheduleError,
    TimedAction,
    add_communication,
    add_optimizer_step,
    forward_only,
    gpipe,
    interleaved_1f1b,
    parse_action,
    simulate,
)

from .helpers import make


def _times(result: object) -> list[tuple[int, str, float, float]]:
    return [(t.rank, str(t.action), t.start, t.end) for t in result.timeline]  # type: ignore[attr-defined]


def test_implicit_messages_take_the_latency() -> None:
    result = simulate(gpipe(2, 1), Costs(forward=1, backward=2, communication=0.5))
    assert _times(result) == [
        (0, "0F0", 0.0, 1.0),
        (0, "0B0", 5.0, 7.0),
        (1, "1F0", 1.5, 2.5),
        (1, "1B0", 2.5, 4.5),
    ]
    assert result.makespan == 7.0
    assert result.busy == (3.0, 3.0)
    assert result.idle == (4.0, 4.0)
    assert result.bubble_fraction == pytest.approx(8 / 14)


def test_sends_are_instant_and_receives_wait() -> None:
    result = simulate(
        add_communication(gpipe(2, 1)), Costs(forward=1, backward=2, communication=0.5)
    )
    assert _times(result) == [
        (0, "0F0", 0.0, 1.0),
        (0, "0SF0", 1.0, 1.0),
        (0, "0RB0", 1.0, 5.0),
        (0, "0B0", 5.0, 7.0),
        (1, "1RF0", 0.0, 1.5),
        (1, "1F0", 1.5, 2.5),
        (1, "1B0", 2.5, 4.5),
        (1, "1SB0", 4.5, 4.5),
    ]
    assert result.busy == (3.0, 3.0)


def test_per_stage_costs() -> None:
    result = simulate(gpipe(2, 1), Costs(forward=(1, 3)))
    assert _times(result)[2:] == [(1, "1F0", 1.0, 4.0), (1, "1B0", 4.0, 10.0)]


def test_reduce_runs_in_the_background_and_step_waits_for_it() -> None:
    schedule = add_optimizer_step(gpipe(2, 1), reduce=True)
    result = simulate(schedule, Costs(forward=1, backward=2, reduce=1, step=0.5))
    assert _times(result)[2:4] == [(0, "0REDUCE", 6.0, 7.0), (0, "0STEP", 7.0, 7.5)]
    assert result.makespan == 7.5
    assert result.busy == (3.5, 3.5)  # the all-reduce is not compute
    # with two stages on a rank, stage 2's all-reduce overlaps stage 0's backwards
    interleaved = simulate(add_optimizer_step(interleaved_1f1b(2, 2), reduce=True), Costs(reduce=2))
    timing = {str(t.action): t for t in interleaved.timeline if t.rank == 0}
    overlap = min(timing["2REDUCE"].end, timing["0B0"].end) - max(
        timing["2REDUCE"].start, timing["0B0"].start
    )
    assert overlap == 2.0  # 0B0 (2 long) runs entirely while stage 2 all-reduces
    assert timing["2STEP"].start >= timing["2REDUCE"].end


def test_peak_activations() -> None:
    assert simulate(gpipe(3, 5)).peak_activations == (5, 5, 5)
    assert simulate(forward_only(3, 5)).peak_activations == (0, 0, 0)


def test_deadlock_raises_schedule_error() -> None:
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0, position 0: 0RB0 waits for 1SB0"):
        simulate(make("0RB0 0F0 0SF0 0B0", "1RF0 1F0 1B0 1SB0"))


def test_costs_must_fit_the_schedule() -> None:
    with pytest.raises(ValueError, match="forward has 3 values but the schedule has 2 stages"):
        simulate(gpipe(2, 1), Costs(forward=(1, 1, 1)))


def test_to_dict_is_json() -> None:
    data = json.loads(json.dumps(simulate(gpipe(2, 1)).to_dict()))
    assert data["makespan"] == 6.0 and data["peak_activations"] == [1, 1]
    assert data["timeline"][0] == {"rank": 0, "action": "0F0", "start": 0.0, "end": 1.0}
    assert "timeline" not in simulate(gpipe(2, 1)).to_dict(timeline=False)


def test_timed_action_is_a_plain_record() -> None:
    record = TimedAction(rank=1, action=parse_action("1F2"), start=0.25, end=0.5)
    assert record == (1, parse_action("1F2"), 0.25, 0.5)
    assert record._replace(end=1.0).end == 1.0
