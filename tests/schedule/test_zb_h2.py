from __future__ import annotations

import pytest

from pipetrain.schedule import Costs, render_grid, simulate, validate, zb_h1, zb_h2

from .helpers import (
    UNIFORM,
    assert_each_w_after_its_i,
    back_to_back,
    full_activation_peaks,
    idle_inside,
    sizes,
)


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(zb_h2(3, 6)) == (
        "rank 0: F0 F1 F2 F3 F4 I0 W0 I1 F5 I2 W1 I3 W2 I4 W3 W4 I5 W5\n"
        "rank 1: .  F0 F1 F2 I0 F3 I1 F4 I2 W0 I3 F5 I4 W1 W2 I5 W3 W4 W5\n"
        "rank 2: .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 W0 F5 I5 W1 W2 W3 W4 W5"
    )


def test_valid_on_the_grid_with_every_w_after_its_i() -> None:
    for num_stages, num_microbatches in sizes():
        schedule = zb_h2(num_stages, num_microbatches)
        validate(schedule)
        assert_each_w_after_its_i(schedule)
        for j, actions in enumerate(schedule.actions):
            assert {a.stage for a in actions} == {j}
            assert sorted((a.op.value, a.microbatch) for a in actions) == sorted(
                (op, i) for op in "FIW" for i in range(num_microbatches)
            )


@pytest.mark.parametrize(
    "num_stages, num_microbatches", [(2, 3), (2, 8), (3, 6), (4, 7), (4, 16), (8, 15), (8, 32)]
)
def test_parallelogram_without_a_gap_when_f_i_w_cost_the_same(
    num_stages: int, num_microbatches: int
) -> None:
    """The paper: zero bubble with F = I = W (M >= 2K-1). Ours: stage j runs from tick j
    to 3M + j without a gap (ZB-H1's rank 0 idles K-1 ticks inside its span); one step
    alone still waits K-1 ticks for the first input, as ZB-H1."""
    k, m = num_stages, num_microbatches
    result = simulate(zb_h2(k, m), UNIFORM)
    assert idle_inside(result) == (0.0,) * k
    for j in range(k):
        mine = [t for t in result.timeline if t.rank == j and t.action.op.is_compute]
        assert (min(t.start for t in mine), max(t.end for t in mine)) == (j, 3 * m + j)
    assert result.makespan == 3 * m + k - 1
    assert result.bubble_fraction == pytest.approx((k - 1) / (3 * m + k - 1))
    h1 = simulate(zb_h1(k, m), UNIFORM)
    assert idle_inside(h1)[0] == k - 1
    assert h1.makespan == result.makespan


@pytest.mark.parametrize("num_stages, num_microbatches", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_back_to_back_steps_add_exactly_their_work(num_stages: int, num_microbatches: int) -> None:
    """With no optimizer step synchronizing the ranks (the paper's post-update
    validation), step 2 starts on rank 0 as soon as step 1 is done there: every step
    after the first adds 3M ticks, zero bubble; ZB-H1 adds 3M + K - 1."""
    k, m = num_stages, num_microbatches
    one = simulate(zb_h2(k, m), UNIFORM).makespan
    three = simulate(back_to_back(zb_h2(k, m), 3), UNIFORM).makespan
    assert three - one == 2 * 3 * m
    h1 = simulate(back_to_back(zb_h1(k, m), 3), UNIFORM).makespan
    assert h1 - simulate(zb_h1(k, m), UNIFORM).makespan == 2 * (3 * m + k - 1)


@pytest.mark.parametrize(
    "num_stages, num_microbatches, h1, h2", [(4, 8, 24.5, 23.0), (4, 16, 44.5, 43.0)]
)
def test_a_single_step_is_shorter_than_zb_h1_s_when_w_is_cheaper(
    num_stages: int, num_microbatches: int, h1: float, h2: float
) -> None:
    """With W = F/2 one step alone is shorter than ZB-H1's (with F = I = W they are equal)."""
    costs = Costs(forward=1, backward_input=1, backward_weight=0.5)
    assert simulate(zb_h1(num_stages, num_microbatches), costs).makespan == h1
    assert simulate(zb_h2(num_stages, num_microbatches), costs).makespan == h2


def test_peak_memory_is_the_papers_2k_minus_1() -> None:
    """The paper's (2p-1) M_B: at most 2K-1 micro-batches in flight (F run, W not yet)
    on every stage, twice ZB-H1's K, less when the step has fewer micro-batches; rank j
    holds at most 2(K-j)-1 full activations (F run, I not yet): its warm-up forwards."""
    for k, m in sizes():
        schedule = zb_h2(k, m)
        assert simulate(schedule).peak_activations == (min(m, 2 * k - 1),) * k
        assert full_activation_peaks(schedule) == tuple(min(m, 2 * (k - j) - 1) for j in range(k))


def test_rejects_counts_below_one() -> None:
    with pytest.raises(ValueError, match="zb-h2: num_stages must be at least 1, got 0"):
        zb_h2(0, 4)
