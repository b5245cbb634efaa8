from __future__ import annotations

import pytest

from pipetrain.schedule import forward_only, render_grid, simulate


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(forward_only(2, 3)) == "rank 0: F0 F1 F2\nrank 1: .  F0 F1 F2"
    assert render_grid(forward_only(4, 2, stages_per_rank=2)) == (
        "rank 0: 0F0 0F1 2F0 2F1\nrank 1: .   1F0 1F1 3F0 3F1"
    )


def test_only_forwards_and_nothing_held() -> None:
    schedule = forward_only(3, 5)
    assert not schedule.is_training
    assert [str(a) for a in schedule.actions[2]] == ["2F0", "2F1", "2F2", "2F3", "2F4"]
    result = simulate(schedule)
    assert result.peak_activations == (0, 0, 0)
    assert result.makespan == 5 + 3 - 1


def test_virtual_stages_are_looped() -> None:
    schedule = forward_only(6, 4, stages_per_rank=2)
    assert schedule.num_ranks == 3
    assert schedule.stage_to_rank == (0, 1, 2, 0, 1, 2)
    # V*M forwards per rank plus the fill of 3 ranks: no waiting between the loops (M >= ranks)
    assert simulate(schedule).makespan == 2 * 4 + 3 - 1


def test_rejects_stages_not_a_multiple_of_stages_per_rank() -> None:
    with pytest.raises(
        ValueError, match="num_stages=5 is not a multiple of stages_per_rank=2; use num_stages=6"
    ):
        forward_only(5, 4, stages_per_rank=2)
