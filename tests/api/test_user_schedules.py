"""Schedules a pipeline takes besides the library's names: Schedule objects and schedule
files, checked when the configuration is made; and the V placement of zb-v and
dualpipe-v. No processes: these are the checks that run before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.api.config import PipelineConfig, config_problems
from pipetrain.api.layout import Layout
from pipetrain.api.step_schedules import StepSchedules
from pipetrain.schedule import Op, build_schedule, parse_schedule, zb_v

# each rank waits for the other: rank 0 for micro-batch 0's gradient, which rank 1 makes
# only after micro-batch 1, whose input rank 0 sends only after that gradient
DEADLOCK = """
rank 0: 0F0 0B0 0F1 0B1
rank 1: 1F1 1B1 1F0 1B0
"""
# micro-batch 1 never runs its backward on stage 1
MISSING = """
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1B0 1F1
"""


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
@pytest.mark.parametrize("stages_per_rank", [1, 3])
def test_v_schedules_refuse_a_stage_count_they_cannot_place(schedule: str, stages_per_rank: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"schedule '{schedule}' places exactly 2 stages per rank \(a V: rank r holds stages "
        rf"r and 2K-1-r\), got stages_per_rank={stages_per_rank}; fix: stages_per_rank=2",
    ):
        PipelineConfig(schedule=schedule, num_stages=3, stages_per_rank=stages_per_rank)


def test_v_schedules_on_more_stages_than_layers_name_the_fix() -> None:
    config = PipelineConfig(schedule="zb-v", num_stages=4, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"8 stages \(4 ranks x 2 stages per rank\) for 6 layers; "
                                         r"fix: use at most 6 stages, e.g. num_stages=3"):
        Layout.create(config, num_layers=6)
    with pytest.raises(ValueError, match=r"balance \[4, 4\] has 2 entries but the pipeline has 8"):
        Layout.create(PipelineConfig(schedule="dualpipe-v", num_stages=4, stages_per_rank=2,
                                     balance=[4, 4]), num_layers=8)


def test_v_placement_in_the_layout_and_the_step_schedules() -> None:
    config = PipelineConfig(schedule="zbv", num_stages=3, stages_per_rank=2, num_microbatches=5,
                            balance=[1, 2, 1, 1, 2, 1])
    layout = Layout.create(config, num_layers=8)
    assert layout.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert layout.stages_of(0) == (0, 5) and layout.stages_of(2) == (2, 3)
    assert [str(c) for c in layout.channels(2)[0]] == ["activations 1->2", "gradients 4->3"]
    schedules = StepSchedules(config, layout)
    training = schedules.get("zb-v", 5)
    assert training.stage_to_rank == layout.stage_to_rank
    evaluation = schedules.get("forward", 5)
    assert evaluation.stage_to_rank == layout.stage_to_rank
    assert {a.stage for a in evaluation.actions[0]} == {0, 5}


def test_looped_bfs_takes_stages_per_rank_of_at_least_2() -> None:
    assert PipelineConfig(schedule="bfs", num_stages=2, stages_per_rank=3).stage_to_rank == (
        0, 1, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="schedule 'looped-bfs' needs at least 2 stages per rank, "
                                         "got stages_per_rank=1; fix: stages_per_rank=2"):
        PipelineConfig(schedule="looped-bfs")


def test_a_schedule_file_is_lowered_validated_and_placed(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(str(zb_v(2, 3)))
    config = PipelineConfig(schedule=str(path), num_stages=2, stages_per_rank=2, num_microbatches=3)
    assert config.schedule_name == "mine" and config.stage_to_rank == (0, 1, 1, 0)
    user = config.user_schedule
    assert user is not None and user.num_microbatches == 3
    ops = {a.op for acts in user.actions for a in acts}
    assert {Op.SEND_FORWARD, Op.RECV_BACKWARD, Op.REDUCE_GRAD, Op.OPTIMIZER_STEP} <= ops
    assert PipelineConfig(schedule=path, num_stages=2, stages_per_rank=2,
                          num_microbatches=3).user_schedule == user
    schedules = StepSchedules(config, Layout.create(config, num_layers=4))
    assert schedules.get("mine", 3) is user
    with pytest.raises(ValueError, match=r"schedule 'mine' runs exactly 3 micro-batches a step, not 2"):
        schedules.get("mine", 2)


def test_a_schedule_object_fully_lowered_runs_as_written() -> None:
    lowered = build_schedule("1f1b", num_ranks=2, num_microbatches=3, optimizer_step=True,
                             reduce=True)
    config = PipelineConfig(schedule=parse_schedule(str(lowered), name="copy"), num_stages=2,
                            num_microbatches=3)
    assert config.user_schedule is not None
    assert config.user_schedule.actions == lowered.actions


def test_a_deadlocking_user_schedule_is_refused_with_the_grid(tmp_path: Path) -> None:
    path = tmp_path / "stuck.txt"
    path.write_text(DEADLOCK)
    with pytest.raises(ValueError) as caught:
        PipelineConfig(schedule=str(path), num_stages=2, num_microbatches=2)
    message = str(caught.value)
    assert f"schedule file {str(path)!r}: schedule 'stuck' (2 ranks, 2 stages, 2 micro-batches)" in message
    assert "deadlock: rank 0, position 2: 0RB0 waits for 1SB0, which rank 1 runs only at position 7" in message
    assert "deadlock: rank 1, position 0: 1RF1 waits for 0SF1, which rank 0 runs only at position 5" in message
    assert "rank 0: 0F0 0SF0 0RB0 0B0 0F1 0SF1 0RB1 0B1 0REDUCE 0STEP" in message  # as lowered
    assert "what it runs (one column per action at unit cost, '.' idle):\nrank 0: F0\nrank 1:" in message


def test_a_user_schedule_missing_an_action_is_refused_with_the_grid() -> None:
    with pytest.raises(ValueError) as caught:
        PipelineConfig(schedule=parse_schedule(MISSING, name="short"), num_stages=2,
                       num_microbatches=2)
    message = str(caught.value)
    assert "the schedule: schedule 'short'" in message
    assert "1B1 is missing (rank 1): no B, nor I and W" in message
    assert "what it runs" in message and "rank 1: .  F0 B0 F1" in message


def test_a_user_schedule_that_does_not_fit_the_configuration_names_each_fix(tmp_path: Path) -> None:
    path = tmp_path / "v.txt"
    path.write_text(str(zb_v(2, 3)))
    problems = config_problems({"schedule": str(path), "num_stages": 3, "num_microbatches": 8,
                                "replicas": 2})
    assert problems == [
        "num_stages=3 but schedule 'v' has 2 ranks; fix: num_stages=2",
        "num_microbatches=8 but schedule 'v' runs 3 micro-batches a step; fix: num_microbatches=3",
        "schedule 'v' is written for one replica per stage; fix: replicas=1 (and no stage_replicas)",
    ]
    assert config_problems({"schedule": str(path), "num_stages": 2, "num_microbatches": 3}) == [
        "stages_per_rank=1 but schedule 'v' places 4 stages on 2 ranks; fix: stages_per_rank=2"
    ]


def test_an_unknown_name_or_a_missing_file_says_both_are_possible(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown schedule '.*nope.txt' \(neither a schedule name "
                                         r"nor an existing schedule file\); choose one of gpipe"):
        PipelineConfig(schedule=str(tmp_path / "nope.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("rank 0: 0F0 0X0\n")
    with pytest.raises(ValueError, match=r"schedule file '.*bad.txt': schedule 'bad': line 1: "
                                         r"unknown op 'X' in action '0X0'"):
        PipelineConfig(schedule=str(bad), num_stages=1)
