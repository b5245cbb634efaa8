from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Costs,
    Op,
    interleaved_1f1b,
    loop_placement,
    one_f_one_b,
    render_grid,
    simulate,
    validate,
)
from pipetrain.schedule.interleaved import microbatch_groups


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(interleaved_1f1b(2, 2)) == (
        "rank 0: 0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1\n"
        "rank 1: .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )


def test_looped_placement_and_megatron_order() -> None:
    schedule = interleaved_1f1b(2, 4, stages_per_rank=2)
    assert schedule.stage_to_rank == loop_placement(2, 2) == (0, 1, 0, 1)
    # rank 0 warms up with (V-1)*K + 2*(K-1) = 4 forwards: stage 0 on micro-batches 0, 1,
    # then stage 2 on them; then one forward, one backward (last stage first)
    assert " ".join(map(str, schedule.actions[0][:8])) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1"


@pytest.mark.parametrize(
    "num_ranks, num_microbatches, stages_per_rank",
    [(2, 2, 2), (2, 5, 2), (4, 4, 2), (4, 9, 2), (4, 9, 3), (3, 7, 4), (8, 17, 2), (1, 3, 3)],
)
def test_every_m_from_k_up_runs_every_microbatch_on_every_stage(
    num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> None:
    schedule = interleaved_1f1b(num_ranks, num_microbatches, stages_per_rank=stages_per_rank)
    validate(schedule)
    for op in (Op.FORWARD, Op.BACKWARD):
        done = sorted(
            (a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.op is op
        )
        assert done == [
            (j, i) for j in range(num_ranks * stages_per_rank) for i in range(num_microbatches)
        ]


def test_groups_are_at_least_k_and_larger_first() -> None:
    assert microbatch_groups(8, 4) == (4, 4)
    assert microbatch_groups(5, 2) == (3, 2)
    assert microbatch_groups(7, 4) == (7,)
    for num_ranks in range(1, 9):
        for num_microbatches in range(num_ranks, 40):
            groups = microbatch_groups(num_microbatches, num_ranks)
            assert sum(groups) == num_microbatches
            assert min(groups) >= num_ranks and list(groups) == sorted(groups, reverse=True)
            assert max(groups) - min(groups) <= 1


@pytest.mark.parametrize(
    "num_ranks, num_microbatches", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (8, 32)]
)
@pytest.mark.parametrize("stages_per_rank", [2, 3, 4])
def test_bubble_time_is_1f1b_divided_by_v(
    num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> None:
    # same work per rank: each of the V stages costs 1/V of a 1F1B stage
    base = simulate(one_f_one_b(num_ranks, num_microbatches), Costs(forward=1))
    result = simulate(
        interleaved_1f1b(num_ranks, num_microbatches, stages_per_rank=stages_per_rank),
        Costs(forward=1 / stages_per_rank),
    )
    assert result.busy == pytest.approx(base.busy)
    assert sum(base.idle) / sum(result.idle) == pytest.approx(stages_per_rank, rel=0.15)


@pytest.mark.parametrize(
    "num_ranks, num_microbatches, stages_per_rank", [(2, 8, 2), (4, 16, 2), (4, 16, 4), (8, 32, 2)]
)
def test_bubble_fraction_is_about_1f1b_divided_by_v(
    num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> None:
    # the fraction's denominator shrinks with the bubble, so the ratio nears V as M grows
    base = simulate(one_f_one_b(num_ranks, num_microbatches)).bubble_fraction
    result = simulate(
        interleaved_1f1b(num_ranks, num_microbatches, stages_per_rank=stages_per_rank),
        Costs(forward=1 / stages_per_rank),
    ).bubble_fraction
    assert base / result == pytest.approx(stages_per_rank, rel=0.15)


def test_m_below_k_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(
        ValueError,
        match=r"interleaved-1f1b needs at least num_ranks micro-batches: got num_microbatches=3 for num_ranks=4; use num_microbatches=4",
    ):
        interleaved_1f1b(4, 3)


def test_one_stage_per_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="stages_per_rank must be at least 2, got 1"):
        interleaved_1f1b(4, 8, stages_per_rank=1)
