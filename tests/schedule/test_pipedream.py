"""PipeDream: the 1F1B order without flushes, the versions of weight stashing and vertical
sync (the paper's formulas), the versions a stage keeps, windows, and bad input."""

from __future__ import annotations

from collections import Counter

import pytest

from pipetrain.schedule import (
    Action,
    AsyncStream,
    Op,
    Schedule,
    ScheduleError,
    add_communication,
    build_schedule,
    find_problems,
    parse_actions,
    pipedream,
    simulate,
    steady_state,
    validate,
    versions_held,
)
from pipetrain.schedule.execution import execute
from pipetrain.schedule.grid import UNIT_COSTS

from .helpers import sizes


def _compute(schedule: Schedule, rank: int) -> list[Action]:
    return [a for a in schedule.actions[rank] if a.op in (Op.FORWARD, Op.BACKWARD)]


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_versions_follow_the_papers_formulas(vertical_sync: bool) -> None:
    """Stage j (0-based) runs micro-batch i with version max(0, i - K + j + 1): the
    paper's w_j^(t-n+j) with 1-based stages; with vertical sync, the input stage's
    max(0, i - K + 1). The backward uses the forward's version."""
    for num_stages, num_microbatches in sizes():
        schedule = pipedream(num_stages, num_microbatches, vertical_sync=vertical_sync)
        for j in range(num_stages):
            lag = num_stages - 1 - (0 if vertical_sync else j)
            seen = {(a.op, a.microbatch): a.version for a in _compute(schedule, j)}
            assert seen == {
                (op, i): max(0, i - lag)
                for op in (Op.FORWARD, Op.BACKWARD) for i in range(num_microbatches)
            }, (num_stages, num_microbatches, j)


def test_one_update_per_microbatch_right_after_its_backward() -> None:
    for num_stages, num_microbatches in sizes():
        for actions in pipedream(num_stages, num_microbatches).actions:
            steps = [p for p, a in enumerate(actions) if a.op is Op.OPTIMIZER_STEP]
            assert len(steps) == num_microbatches
            assert all(actions[p - 1].op is Op.BACKWARD for p in steps)
            assert [actions[p].version for p in steps] == list(range(1, num_microbatches + 1))


def test_input_stage_admits_noam_microbatches_then_alternates() -> None:
    """NOAM = ceil(workers / input-stage replicas) forwards before the first backward."""
    for replicas, noam in (([1, 1, 1, 1], 4), ([2, 1, 1], 2), ([1, 2], 3), ([3, 3], 2)):
        schedule = pipedream(len(replicas), 12, replicas=replicas)
        for rank in schedule.ranks_of(0):
            ops = [a.op for a in _compute(schedule, rank)]
            assert ops.index(Op.BACKWARD) == noam, (replicas, rank)
            steady = ops[noam - 1 : len(ops) - noam + 1]
            assert steady == [Op.FORWARD, Op.BACKWARD] * (len(steady) // 2), replicas


def test_the_order_is_1f1b_without_the_flush() -> None:
    """Without versions and steps, a window and its drain are the 1F1B step of as many."""
    for num_stages, num_microbatches in sizes():
        schedule = pipedream(num_stages, num_microbatches)
        flushed = build_schedule("1f1b", num_ranks=num_stages, num_microbatches=num_microbatches,
                                 communication=False)
        for r in range(num_stages):
            plain = [Action(a.stage, a.op, a.microbatch) for a in _compute(schedule, r)]
            assert plain == list(flushed.actions[r])


def test_validates_on_the_grid_with_messages_and_replicas() -> None:
    for num_stages, num_microbatches in sizes():
        for vertical_sync in (False, True):
            build_schedule("pipedream", num_ranks=num_stages, num_microbatches=num_microbatches,
                           vertical_sync=vertical_sync, num_steps=2)
    for replicas in ([2, 1], [1, 2], [2, 2], [3, 1, 2], [1, 1, 3]):
        for count in (6, 12):
            build_schedule("pipedream", num_ranks=len(replicas), num_microbatches=count,
                           replicas=replicas, num_steps=3)
    build_schedule("pipedream", num_ranks=3, num_microbatches=4, replicas=[2, 2, 2],
                   vertical_sync=True, num_steps=3)


def test_replicas_update_together_once_per_round() -> None:
    schedule = pipedream(2, 8, replicas=[2, 1])
    for rank in (0, 1):
        actions = schedule.actions[rank]
        steps = [p for p, a in enumerate(actions) if a.op is Op.OPTIMIZER_STEP]
        assert len(steps) == 4  # 4 rounds of 2 micro-batches
        assert all(actions[p - 1].op is Op.REDUCE_GRAD for p in steps)
    assert [a.microbatch for a in _compute(schedule, 1) if a.op is Op.FORWARD] == [1, 3, 5, 7]


def test_stage_keeps_its_microbatches_in_flight_versions() -> None:
    """Weight stashing keeps one version per micro-batch in flight: K - j on stage j
    (PipeDream's bound); vertical sync keeps the input stage's K on every stage."""
    for num_stages in range(1, 7):
        for vertical_sync, expected in ((False, [num_stages - j for j in range(num_stages)]),
                                        (True, [num_stages] * num_stages)):
            schedule = pipedream(num_stages, 4 * num_stages, vertical_sync=vertical_sync)
            held = versions_held(schedule)
            assert [held[(j, j)] for j in range(num_stages)] == expected, (num_stages, vertical_sync)
            in_flight = simulate(schedule).peak_activations
            assert all(held[(j, j)] <= in_flight[j] or vertical_sync for j in range(num_stages))


def _windows(stream: AsyncStream, counts: list[int | str]) -> list[list[list[Action]]]:
    return [stream.drain() if c == "drain" else stream.window(c) for c in counts]  # type: ignore[arg-type]


@pytest.mark.parametrize("kind, replicas, counts", [
    ("pipedream", [1, 1, 1, 1], [3, 5, 1, 4, "drain", 2, 7]),
    ("pipedream", [2, 1, 1], [4, 2, "drain", 6]),
    ("pipedream", [1, 2], [2, 4, 2]),
    ("2bw", [1, 1, 1], [3, 3, 4, "drain", 5, 3]),
    ("2bw", [2, 1], [4, 6, "drain", 4]),
])
def test_every_window_runs_without_the_next(kind: str, replicas: list[int], counts: list[int | str]) -> None:
    """A training step runs one window on every rank and ends with a collective: each
    prefix of windows must run to its end with no message from a later window, and the
    replicas of a stage update in the same window."""
    stream = AsyncStream(kind, replicas)
    windows = [*_windows(stream, counts), stream.drain()]
    total = stream.admitted
    for end in range(1, len(windows) + 1):
        prefix = Schedule(name=kind, num_microbatches=total, stage_to_rank=tuple(g[0] for g in stream.groups),
                          actions=tuple(tuple(a for w in windows[:end] for a in w[r]) for r in range(stream.num_ranks)),
                          replicas=stream.groups if max(replicas) > 1 else ())
        lowered = add_communication(prefix)
        assert execute(lowered, UNIT_COSTS.per_stage(len(replicas))).blocked == (), (kind, end)
        if end == len(windows):
            validate(lowered)
        for group in stream.groups:
            steps = {sum(a.op is Op.OPTIMIZER_STEP for a in windows[end - 1][r]) for r in group}
            assert len(steps) == 1, (kind, end, group)


def test_steps_that_end_together_cost_k_minus_1_forwards_not_a_flush() -> None:
    """A Pipeline's step ends on every rank together: per step, the first stage waits
    for the last forward to cross the others, (K - 1) forward times, where 1F1B's flush
    costs (K - 1) forward and backward times."""
    from pipetrain.schedule import Costs
    from pipetrain.schedule.steady_state import window_time

    for kind in ("pipedream", "2bw"):
        for num_stages in (1, 2, 4, 8):
            for count in (8, 16):
                per = window_time(AsyncStream(kind, [1] * num_stages), count, Costs())
                assert per == pytest.approx((3 * count + num_stages - 1) / count)


def test_steady_state_has_no_flush_bubble() -> None:
    """Forward 1, backward 2: one micro-batch every 3 on any number of stages, where
    1F1B pays its fill and drain every step of M micro-batches."""
    for num_stages in (2, 4, 8):
        schedule = pipedream(num_stages, 8, num_steps=16)
        state = steady_state(schedule, simulate(schedule).timeline)
        flushed = simulate(build_schedule("1f1b", num_ranks=num_stages, num_microbatches=8))
        assert state.steady == 3.0
        assert state.speedup_over(flushed.makespan / 8) == pytest.approx((8 + num_stages - 1) / 8)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"vertical_sync needs the same replica count on every stage, got \[2, 1\]"):
        pipedream(2, 4, replicas=[2, 1], vertical_sync=True)
    with pytest.raises(ValueError, match=r"multiple of every replica count .* got 3; fix: a multiple of 2"):
        pipedream(2, 3, replicas=[1, 2])
    with pytest.raises(ValueError, match=r"replicas \[1\] has 1 entries for 2 stages"):
        pipedream(2, 3, replicas=[1])
    with pytest.raises(ValueError, match="num_microbatches must be at least 1, got 0"):
        pipedream(2, 0)
    with pytest.raises(ValueError, match="vertical_sync is an option of 'pipedream', not of '2bw'"):
        build_schedule("2bw", num_ranks=2, num_microbatches=2, vertical_sync=True)
    with pytest.raises(ValueError, match="not of '1f1b'"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=2, num_steps=2)
    with pytest.raises(ValueError, match="pipedream has one stage per rank"):
        build_schedule("pipedream", num_ranks=2, num_microbatches=2, stages_per_rank=2)


def test_validator_checks_the_versions() -> None:
    def problems(*rank_lists: str) -> list[str]:
        return find_problems(Schedule(
            name="toy", num_microbatches=2, stage_to_rank=tuple(range(len(rank_lists))),
            actions=tuple(tuple(parse_actions(t)) for t in rank_lists)))

    assert problems("0F0v0 0B0v0 0STEPv1 0F1v1 0B1v1 0STEPv2") == []
    assert problems("0F0v0 0B0v0 0STEPv2 0F1v1 0B1v1 0STEPv3") == [
        "rank 0, position 2: 0STEPv2 should produce version 1 (step 1 of stage 0 on this rank)",
        "rank 0, position 5: 0STEPv3 should produce version 2 (step 2 of stage 0 on this rank)",
    ]
    assert problems("0F0v0 0B0 0STEPv1 0F1v1 0B1v1 0STEPv2") == [
        "rank 0, position 1: 0B0 has no weight version (every F, B and STEP of an asynchronous "
        "schedule has one)"]
    assert problems("0F0v0 0F1v1 0B0v0 0STEPv1 0B1v1 0STEPv2") == [
        "rank 0, position 1: 0F1v1 uses version 1, but stage 0 has produced versions 0..0 here"]
    with pytest.raises(ScheduleError, match="a backward uses its forward's weights"):
        validate(Schedule(name="toy", num_microbatches=2, stage_to_rank=(0,), actions=(
            tuple(parse_actions("0F0v0 0F1v0 0B0v0 0STEPv1 0B1v1 0STEPv2")),)))


def test_stream_counts_and_drains() -> None:
    stream = AsyncStream("pipedream", [1, 1, 1])
    stream.window(2)
    assert stream.in_flight and stream.admitted == 2 and stream.num_batches == 1
    drained = stream.drain()
    assert not stream.in_flight
    assert Counter(a.op for acts in drained for a in acts) == {Op.BACKWARD: 3, Op.OPTIMIZER_STEP: 3}
    assert stream.next_forward_versions(3) == [2, 2, 2]  # after a flush, every stage is current


def test_simulate_command_shows_the_steady_state(capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli.main import main

    assert main(["simulate", "--schedule", "pipedream", "--stages", "4", "--microbatches", "8",
                 "--steps", "8"]) == 0
    text = capsys.readouterr().out
    assert "rank 3: .      .      .      F0v0   B0v0   F1v1" in text
    assert ("steady state (a long run): one micro-batch every 3; the 8 steps of 8 above, without "
            "flushes: 3.14062 per micro-batch, fill and drain included; 1f1b with a flush every 8 micro-batches: "
            "4.125 per micro-batch (1.38x). Pipeline.train_step ends each step on every rank "
            "together: 3.375 per micro-batch (1.22x 1f1b)") in text
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
                 "--vertical-sync"]) == 2
    assert "--steps and --vertical-sync are for pipedream, 2bw, not 1f1b" in capsys.readouterr().err
