from __future__ import annotations

import pytest

from pipetrain.schedule import Costs, gpipe, render_grid, simulate


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(gpipe(3, 4)) == (
        "rank 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3\n"
        "rank 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3\n"
        "rank 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3"
    )


def test_each_stage_runs_every_forward_then_every_backward() -> None:
    schedule = gpipe(2, 3)
    assert [str(a) for a in schedule.actions[1]] == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]
    assert schedule.stage_to_rank == (0, 1)


@pytest.mark.parametrize(
    "num_stages, num_microbatches", [(1, 1), (2, 4), (4, 4), (4, 16), (8, 3), (8, 32)]
)
@pytest.mark.parametrize("costs", [Costs(), Costs(forward=1, backward=3)])
def test_bubble_is_k_minus_1_over_m_plus_k_minus_1(
    num_stages: int, num_microbatches: int, costs: Costs
) -> None:
    result = simulate(gpipe(num_stages, num_microbatches), costs)
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert result.bubble_fraction == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_every_stage_holds_every_microbatch() -> None:
    assert simulate(gpipe(4, 6)).peak_activations == (6, 6, 6, 6)


@pytest.mark.parametrize(
    "args, bad",
    [
        ((0, 4), "num_stages must be at least 1, got 0"),
        ((4, 0), "num_microbatches must be at least 1, got 0"),
    ],
)
def test_rejects_counts_below_one(args: tuple[int, int], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        gpipe(*args)


def test_rejects_non_int() -> None:
    with pytest.raises(TypeError, match=r"num_stages must be an int, got 2\.0"):
        gpipe(2.0, 4)  # type: ignore[arg-type]
