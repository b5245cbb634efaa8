from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Costs,
    Op,
    gpipe,
    loop_placement,
    looped_bfs,
    render_grid,
    simulate,
    validate,
)

from .helpers import sizes


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(looped_bfs(2, 2)) == (
        "rank 0: 0F0 0F1 2F0 2F1 .   .   2B1 2B0 0B1 0B0\n"
        "rank 1: .   1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"
    )


@pytest.mark.parametrize("stages_per_rank", [2, 3, 4])
def test_breadth_first_on_the_grid(stages_per_rank: int) -> None:
    """Every micro-batch of a stage before the rank's next stage; backwards last stage
    first, last micro-batch first; valid for every K, M (also M < K)."""
    v = stages_per_rank
    for k, m in sizes():
        schedule = looped_bfs(k, m, stages_per_rank=v)
        validate(schedule)
        assert schedule.stage_to_rank == loop_placement(k, v)
        for r, actions in enumerate(schedule.actions):
            own = list(range(r, k * v, k))
            assert [(a.op, a.stage, a.microbatch) for a in actions] == (
                [(Op.FORWARD, j, i) for j in own for i in range(m)]
                + [(Op.BACKWARD, j, i) for j in reversed(own) for i in reversed(range(m))]
            )


@pytest.mark.parametrize("num_ranks, num_microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("stages_per_rank", [2, 3, 4])
def test_bubble_time_is_gpipe_s_divided_by_v(
    num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> None:
    """Same work per rank (each of the V stages costs 1/V of a GPipe stage), M >= K:
    every rank idles (K-1)(F+B)/V, GPipe's (K-1)(F+B) divided by V."""
    k, m, v = num_ranks, num_microbatches, stages_per_rank
    base = simulate(gpipe(k, m), Costs(forward=1))
    result = simulate(looped_bfs(k, m, stages_per_rank=v), Costs(forward=1 / v))
    assert result.busy == pytest.approx(base.busy)
    assert result.idle == pytest.approx(tuple(i / v for i in base.idle))
    assert base.idle == pytest.approx((3 * (k - 1),) * k)


def test_peak_memory_is_every_microbatch_of_every_stage() -> None:
    for k, m in sizes():
        assert simulate(looped_bfs(k, m, stages_per_rank=3)).peak_activations == (3 * m,) * k


def test_one_stage_per_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="looped-bfs: stages_per_rank must be at least 2, got 1"):
        looped_bfs(4, 8, stages_per_rank=1)
