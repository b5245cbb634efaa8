from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Action,
    Op,
    ScheduleError,
    add_communication,
    add_fsdp_actions,
    build_schedule,
    find_problems,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    validate,
    zb_h1,
)

from .helpers import make


def _problems(*rank_lists: str, **options: object) -> list[str]:
    return find_problems(make(*rank_lists, **options))  # type: ignore[arg-type]


def test_generated_schedules_are_valid_with_and_without_messages() -> None:
    for schedule in (gpipe(3, 4), one_f_one_b(4, 8), zb_h1(4, 5), interleaved_1f1b(3, 7)):
        validate(schedule)
        validate(add_communication(schedule))


def test_backward_before_forward() -> None:
    assert _problems("0B0 0F0") == ["rank 0, position 0: 0B0 runs before 0F0"]


def test_w_before_i() -> None:
    assert _problems("0F0 0W0 0I0") == ["rank 0, position 1: 0W0 runs before 0I0"]


def test_missing_receive() -> None:
    problems = _problems("0F0 0SF0 0RB0 0B0", "1F0 1B0 1SB0")
    assert problems == [
        "rank 1, position 0: 1F0 has no 1RF0 before it",
        "rank 0, position 1: 0SF0 has no matching 1RF0",
    ]


def test_unmatched_and_duplicated_sends() -> None:
    problems = _problems("0F0 0SF0 0SF0 0RB0 0B0", "1RF0 1F0 1B0 1SB0 1SF0")
    assert (
        "rank 0, position 2: 0SF0 runs 2 times but each message is sent and received exactly once"
        in problems
    )
    assert "rank 1, position 4: 1SF0 has no stage 2 to talk to" in problems


def test_receive_without_send() -> None:
    assert _problems("0F0 0SF0 0RB0 0B0", "1RF0 1F0 1B0") == [
        "rank 0, position 2: 0RB0 has no matching 1SB0",
        "deadlock: rank 0, position 2: 0RB0 waits for 1SB0, which no rank runs",
    ]


def test_deadlock_cycle_names_each_stuck_rank() -> None:
    # each rank receives before it sends what the other one waits for
    problems = _problems("0RB0 0F0 0SF0 0B0", "1RF0 1F0 1B0 1SB0")
    assert problems == [
        "deadlock: rank 0, position 0: 0RB0 waits for 1SB0, which rank 1 runs only at position 3",
        "deadlock: rank 1, position 0: 1RF0 waits for 0SF0, which rank 0 runs only at position 2",
    ]


def test_deadlock_of_a_compute_only_schedule() -> None:
    problems = _problems("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", num_microbatches=2)
    assert problems == [
        "deadlock: rank 0, position 1: 0B0 waits for 1B0, which rank 1 runs only at position 2",
        "deadlock: rank 1, position 0: 1F1 waits for 0F1, which rank 0 runs only at position 2",
    ]


def test_wrong_rank_and_ranges() -> None:
    problems = _problems("0F0 1F0 0B0 0F1", "1B0 1STEP 5F0", num_microbatches=1)
    assert "rank 0, position 1: 1F0 is for stage 1, which lives on rank 1, not rank 0" in problems
    assert "rank 0, position 3: 0F1 needs a micro-batch in 0..0, got 1" in problems
    assert "rank 1, position 2: 5F0 names stage 5, but the schedule has stages 0..1" in problems
    assert "1F0 is missing (rank 1)" in problems


def test_messages_between_stages_of_one_rank() -> None:
    problems = _problems("0F0 0SF0 1RF0 1F0 1B0 1SB0 0RB0 0B0", stage_to_rank=(0, 0))
    assert (
        "rank 0, position 1: 0SF0 talks to stage 1 on the same rank (the hand-off is local; remove it)"
        in problems
    )
    assert (
        "rank 0, position 2: 1RF0 talks to stage 0 on the same rank (the hand-off is local; remove it)"
        in problems
    )


def test_missing_and_doubled_backward() -> None:
    problems = _problems("0F0 0F1 0B0 0I1 0B0", num_microbatches=2)
    assert "0B0 runs 2 times (rank 0 position 2, rank 0 position 4)" in problems
    assert "0W1 is missing: 0I1 (rank 0 position 3) needs a W" in problems


def test_forward_only_needs_only_forwards() -> None:
    assert _problems("0F0 0F1", "1F0 1F1", num_microbatches=2) == []
    assert _problems("0F0", "", num_microbatches=1) == ["1F0 is missing (rank 1)"]


def test_reduce_and_step_order() -> None:
    problems = _problems("0F0 0REDUCE 0STEP 0B0 0REDUCE")
    assert "rank 0, position 1: 0REDUCE runs before 0B0" in problems
    assert "rank 0, position 2: 0STEP runs before 0B0" in problems
    assert "rank 0, position 4: 0REDUCE runs 2 times" in problems
    assert _problems("0F0 0B0 0STEP 0REDUCE") == ["rank 0, position 2: 0STEP runs before 0REDUCE"]


def test_error_reports_every_problem_then_the_grid() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(make("0B0 0F0 0W1", num_microbatches=2))
    error = caught.value
    assert isinstance(error, ValueError)
    assert len(error.problems) == 3
    text = str(error)
    assert text.startswith(
        "schedule 'hand-made' (1 rank, 1 stage, 2 micro-batches) has 3 problems:\n"
    )
    assert "  - rank 0, position 0: 0B0 runs before 0F0\n" in text
    assert "  - 0F1 is missing (rank 0)\n" in text
    assert "  - 0W1 (rank 0 position 2) has no 0I1\n" in text
    assert text.endswith(
        "what it runs (one column per action at unit cost, '.' idle):\nrank 0: B0 F0 W1"
    )


def test_grid_of_a_deadlocked_schedule_shows_what_ran() -> None:
    with pytest.raises(ScheduleError) as caught:
        validate(make("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", num_microbatches=2))
    assert str(caught.value).endswith("rank 0: F0\nrank 1:")


def test_fsdp_gathers_pair_up_around_the_stage_work() -> None:
    assert _problems("0UNSHARD 0F0 0B0 0REDUCE 0RESHARD 0STEP") == []
    problems = _problems("0F0 0UNSHARD 0UNSHARD 0B0 0REDUCE 0STEP 0RESHARD 0RESHARD")
    assert problems == [
        "rank 0, position 0: 0F0 runs on sharded parameters; fix: 0UNSHARD before it",
        "rank 0, position 2: 0UNSHARD gathers parameters already gathered (no 0RESHARD since "
        "the last 0UNSHARD)",
        "rank 0, position 5: 0STEP updates stage 0 while its parameters are gathered; fix: "
        "0RESHARD before it",
        "rank 0, position 7: 0RESHARD frees parameters that are not gathered",
    ]
    assert _problems("0UNSHARD 0F0 0B0 0REDUCE 0STEP") == [
        "rank 0, position 4: 0STEP updates stage 0 while its parameters are gathered; fix: "
        "0RESHARD before it",
        "rank 0: stage 0's parameters are still gathered at the end; fix: 0RESHARD after its "
        "last action",
    ]
    # each gather is a collective of the stage's replicas: as many on each
    replicated = add_fsdp_actions(build_schedule("1f1b", num_ranks=2, num_microbatches=4,
                                                 optimizer_step=True, reduce=True,
                                                 replicas=(2, 2)))
    regathered = [list(acts) for acts in replicated.actions]
    step = regathered[1].index(Action(0, Op.OPTIMIZER_STEP))
    regathered[1][step:step] = [Action(0, Op.UNSHARD), Action(0, Op.RESHARD)]
    assert find_problems(replicated.replace_actions(regathered)) == [
        "stage 0's replicas gather its parameters a different number of times (rank 0: 1, "
        "rank 1: 2): each gather is a collective of all of them"]
