from __future__ import annotations

import json

import pytest

from pipetrain.schedule import (
    Costs,
    Op,
    Schedule,
    TimedAction,
    build_schedule,
    parse_action,
    simulate,
)
from pipetrain.trace import COST_NAMES, StepMeasure, aggregate, measure_step

# distinct per-stage costs, so a stage mixed up with another shows
COSTS = {
    "forward": (1.0, 2.0, 1.5, 1.25),
    "backward": (2.0, 3.0, 2.5, 2.75),
    "backward_input": (1.0, 1.5, 1.25, 1.75),
    "backward_weight": (1.25, 1.0, 2.0, 0.5),
    "communication": (0.1, 0.2, 0.3, 0.4),
    "reduce": (0.5, 0.6, 0.7, 0.8),
    "step": (0.2, 0.3, 0.4, 0.5),
}
CASES = [  # name, num_ranks, stages_per_rank
    ("gpipe", 4, 1),
    ("1f1b", 4, 1),
    ("1f1b", 1, 1),
    ("interleaved-1f1b", 2, 2),
    ("zb-h1", 4, 1),
]


def _costs(num_stages: int, **overrides: tuple[float, ...]) -> Costs:
    values = {name: v[:num_stages] for name, v in {**COSTS, **overrides}.items()}
    return Costs(**values)


def _schedule(name: str, num_ranks: int, stages_per_rank: int) -> Schedule:
    training = name != "forward"
    return build_schedule(
        name,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_microbatches=8,
        optimizer_step=training,
        reduce=training,
    )


def _t(rank: int, action: str, start: float, end: float) -> TimedAction:
    return TimedAction(rank, parse_action(action), start, end)


@pytest.mark.parametrize(("name", "num_ranks", "stages_per_rank"), [*CASES, ("forward", 3, 1)])
def test_measured_bubble_of_a_simulated_step_is_the_simulators(
    name: str, num_ranks: int, stages_per_rank: int
) -> None:
    schedule = _schedule(name, num_ranks, stages_per_rank)
    result = simulate(schedule, _costs(schedule.num_stages))
    measure = measure_step(result.timeline)
    assert measure.makespan == result.makespan
    assert measure.busy == pytest.approx(result.busy)
    assert measure.idle == pytest.approx(result.idle)
    assert measure.bubble_fraction == pytest.approx(result.bubble_fraction, abs=1e-12)
    assert 0 < measure.bubble_fraction < 1 or num_ranks == 1
    # the receives' spans are what the ranks waited, inside their idle time
    for r in range(num_ranks):
        waited = sum(
            t.end - t.start
            for t in result.timeline
            if t.rank == r and t.action.op in (Op.RECV_FORWARD, Op.RECV_BACKWARD)
        )
        assert measure.wait[r] == pytest.approx(waited)
        assert measure.wait[r] <= measure.idle[r] + 1e-9


@pytest.mark.parametrize(("name", "num_ranks", "stages_per_rank"), CASES)
def test_mean_costs_recover_the_simulated_costs_and_makespan(
    name: str, num_ranks: int, stages_per_rank: int
) -> None:
    schedule = _schedule(name, num_ranks, stages_per_rank)
    num_stages = schedule.num_stages
    # interleaved-1f1b on 2 ranks: no receive ever waits for stage 2's messages, so its
    # latency is filled in from the others; one latency for all keeps that exact
    uniform = {"communication": (0.25,) * 4} if name == "interleaved-1f1b" else {}
    costs = _costs(num_stages, **uniform)
    expected = costs.per_stage(num_stages)
    result = simulate(schedule, costs)

    measure = measure_step(result.timeline)
    recovered = measure.mean_costs.per_stage(num_stages)

    split = name == "zb-h1"
    assert recovered.forward == pytest.approx(expected.forward)
    assert recovered.reduce == pytest.approx(expected.reduce)
    assert recovered.step == pytest.approx(expected.step)
    if split:  # I and W measured; B never ran: estimated as I + W
        assert recovered.backward_input == pytest.approx(expected.backward_input)
        assert recovered.backward_weight == pytest.approx(expected.backward_weight)
        assert recovered.backward == pytest.approx(
            [i + w for i, w in zip(expected.backward_input, expected.backward_weight)]
        )
        assert measure.measured_costs["backward"] == (None,) * num_stages
    else:  # B measured; I and W never ran: the Costs default, half of B
        assert recovered.backward == pytest.approx(expected.backward)
        assert recovered.backward_input == pytest.approx([b / 2 for b in expected.backward])
    if num_ranks > 1:
        assert recovered.communication == pytest.approx(expected.communication)
    else:  # no messages: no latency measured, the default 0
        assert measure.measured_costs["communication"] == (None,)
        assert recovered.communication == (0.0,)
    assert simulate(schedule, measure.mean_costs).makespan == pytest.approx(result.makespan)


def test_forward_only_step() -> None:
    schedule = _schedule("forward", 3, 1)
    result = simulate(schedule, _costs(3))
    measure = measure_step(result.timeline)
    assert measure.measured_costs["backward"] == (None, None, None)
    costs = measure.mean_costs
    assert costs.forward == pytest.approx(COSTS["forward"][:3])
    assert costs.backward is None and costs.step == 0.0
    assert simulate(schedule, costs).makespan == pytest.approx(result.makespan)


def test_hand_recorded_step_with_a_silent_rank() -> None:
    # rank 0: F, send, wait for the gradient, B, launch the all-reduce, step (which
    # waits for it); rank 1: wait for the activation, F, B, send; rank 2 recorded nothing
    timeline = [
        _t(0, "0F0", 0.000, 0.010),
        _t(0, "0SF0", 0.010, 0.0101),
        _t(0, "0RB0", 0.0101, 0.045),
        _t(0, "0B0", 0.045, 0.065),
        _t(0, "0REDUCE", 0.065, 0.0651),
        _t(0, "0STEP", 0.0651, 0.070),
        _t(1, "1RF0", 0.000, 0.012),
        _t(1, "1F0", 0.012, 0.022),
        _t(1, "1B0", 0.022, 0.042),
        _t(1, "1SB0", 0.042, 0.043),
    ]
    measure = measure_step(timeline, num_ranks=3)
    assert measure.num_ranks == 3 and measure.num_stages == 2
    assert measure.makespan == pytest.approx(0.070)
    assert measure.busy == pytest.approx((0.010 + 0.020 + 0.0049, 0.030, 0.0))
    assert measure.idle[2] == pytest.approx(0.070)
    assert measure.wait == pytest.approx((0.0349, 0.012, 0.0))
    assert measure.bubble_fraction == pytest.approx(1 - (0.0349 + 0.030) / (3 * 0.070))
    latency = measure.measured_costs["communication"]
    # 1RF0 was reached before 0SF0 ended: latency = 0.012 - 0.0101; 0RB0 likewise
    assert latency == pytest.approx((0.012 - 0.0101, 0.045 - 0.043))
    assert measure.measured_costs["reduce"] == pytest.approx((0.0001, None))


def test_a_receive_that_found_its_message_tells_no_latency() -> None:
    timeline = [
        _t(0, "0F0", 0.0, 1.0),
        _t(0, "0SF0", 1.0, 1.0),
        _t(1, "1RF0", 3.0, 3.001),  # reached two seconds after the send
        _t(1, "1F0", 3.001, 4.0),
    ]
    assert measure_step(timeline).measured_costs["communication"] == (None, None)


def test_offsets_align_ranks_with_their_own_origins() -> None:
    result = simulate(_schedule("1f1b", 4, 1), _costs(4))
    offsets = [0.0, 0.25, 1.5, 3.0]
    shifted = [
        TimedAction(t.rank, t.action, t.start - offsets[t.rank], t.end - offsets[t.rank])
        for t in result.timeline
    ]
    aligned = measure_step(shifted, offsets=offsets)
    assert aligned.makespan == pytest.approx(result.makespan)
    assert aligned.bubble_fraction == pytest.approx(result.bubble_fraction)
    assert aligned.measured_costs["communication"] == pytest.approx(COSTS["communication"])
    unaligned = measure_step(shifted)
    assert unaligned.makespan != pytest.approx(result.makespan)


def test_a_stage_missing_an_op_gets_the_mean_of_the_others() -> None:
    timeline = [
        _t(0, "0F0", 0.0, 1.0),
        _t(0, "0B0", 1.0, 3.0),
        _t(1, "1F0", 0.0, 3.0),
        _t(1, "1I0", 3.0, 4.0),
        _t(1, "1W0", 4.0, 6.0),
        _t(2, "2F0", 0.0, 2.0),
    ]
    measure = measure_step(timeline)
    assert measure.measured_costs["backward"] == (2.0, None, None)
    costs = measure.mean_costs
    assert costs.backward == (2.0, 3.0, 2.5)  # stage 1: I + W; stage 2: mean of 0 and 1
    assert costs.backward_input == (1.0, 1.0, 1.0)
    assert costs.step == 0.0


def test_empty_step() -> None:
    measure = measure_step([], num_ranks=2)
    assert (measure.makespan, measure.busy, measure.bubble_fraction) == (0.0, (0.0, 0.0), 0.0)
    with pytest.raises(ValueError, match="ran no forward"):
        _ = measure.mean_costs


def test_counts_smaller_than_the_timeline_are_refused() -> None:
    timeline = [_t(2, "3F0", 0.0, 1.0)]
    with pytest.raises(ValueError) as info:
        measure_step(timeline, num_ranks=2, num_stages=3)
    assert "num_ranks=2 but the timeline has rank 2; pass num_ranks=3" in str(info.value)
    assert "num_stages=3 but the timeline has stage 3; pass num_stages=4" in str(info.value)
    with pytest.raises(ValueError, match="ends before it starts"):
        measure_step([_t(0, "0F0", 1.0, 0.0)])


def test_aggregate_takes_medians_and_keeps_the_shape() -> None:
    schedule = _schedule("1f1b", 2, 1)
    steps = [
        measure_step(simulate(schedule, _costs(2, forward=(f, 2.0))).timeline)
        for f in (1.0, 1.5, 9.0)  # the last one an outlier
    ]
    summary = aggregate(steps)
    middle = steps[1]  # the median of every figure that grows with the forward cost
    assert summary.num_steps == 3
    assert summary.makespan == middle.makespan
    assert summary.busy == middle.busy
    assert summary.wait[1] == middle.wait[1]
    # the bubble is the median of the steps' bubbles (here not the middle step's)
    bubbles = sorted(m.bubble_fraction for m in steps)
    assert summary.bubble_fraction == bubbles[1] != middle.bubble_fraction
    assert summary.measured_costs["forward"] == pytest.approx((1.5, 2.0))
    assert aggregate([summary, summary]).num_steps == 6
    with pytest.raises(ValueError, match="at least one"):
        aggregate([])
    other = measure_step(simulate(_schedule("1f1b", 3, 1)).timeline)
    with pytest.raises(ValueError, match=r"different shapes .*\(2, 2\), \(3, 3\)"):
        aggregate([summary, other])


def test_to_dict_is_json() -> None:
    measure = measure_step(simulate(_schedule("zb-h1", 2, 1), _costs(2)).timeline)
    data = json.loads(json.dumps(measure.to_dict()))
    assert set(data) == {
        "num_steps",
        "makespan",
        "busy",
        "idle",
        "wait",
        "bubble_fraction",
        "measured_costs",
    }
    assert set(data["measured_costs"]) == set(COST_NAMES)
    assert data["measured_costs"]["backward"] == [None, None]
    assert data["bubble_fraction"] == measure.bubble_fraction


def test_measure_is_immutable_and_hashable() -> None:
    measure = measure_step(simulate(_schedule("gpipe", 2, 1)).timeline)
    with pytest.raises(TypeError):
        measure.measured_costs["forward"] = (0.0, 0.0)
    assert isinstance(hash(measure), int)
    assert measure == StepMeasure(**{**vars(measure)})
