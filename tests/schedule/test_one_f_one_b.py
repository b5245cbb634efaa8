from __future__ import annotations

import pytest

from pipetrain.schedule import gpipe, one_f_one_b, render_grid, simulate

from .helpers import sizes


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(one_f_one_b(3, 4)) == (
        "rank 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3\n"
        "rank 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
        "rank 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3"
    )


def test_warmup_then_alternation_then_cooldown() -> None:
    schedule = one_f_one_b(4, 6)
    assert " ".join(map(str, schedule.actions[1])) == (
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5"
    )


@pytest.mark.parametrize(
    "num_stages, num_microbatches", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 3), (8, 32)]
)
def test_same_bubble_as_gpipe(num_stages: int, num_microbatches: int) -> None:
    result = simulate(one_f_one_b(num_stages, num_microbatches))
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert result.bubble_fraction == pytest.approx(expected, rel=1e-12)
    assert result.makespan == simulate(gpipe(num_stages, num_microbatches)).makespan


def test_stage_j_holds_at_most_min_k_minus_j_and_m() -> None:
    for num_stages, num_microbatches in sizes():
        peaks = simulate(one_f_one_b(num_stages, num_microbatches)).peak_activations
        assert peaks == tuple(min(num_stages - j, num_microbatches) for j in range(num_stages))
        assert (
            simulate(gpipe(num_stages, num_microbatches)).peak_activations
            == (num_microbatches,) * num_stages
        )


def test_rejects_counts_below_one() -> None:
    with pytest.raises(
        ValueError,
        match="1f1b: num_stages must be at least 1, got -1; num_microbatches must be at least 1, got 0",
    ):
        one_f_one_b(-1, 0)
