from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Costs,
    one_f_one_b,
    render_grid,
    simulate,
    v_placement,
    validate,
    zb_h1,
    zb_v,
)

from .helpers import UNIFORM, assert_each_w_after_its_i, sizes


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(zb_v(2, 3)) == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2\n"
        "rank 1: .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2"
    )


def test_v_placement_and_split_backward_on_the_grid() -> None:
    for k, m in sizes():
        schedule = zb_v(k, m)
        validate(schedule)
        assert schedule.stage_to_rank == v_placement(k)
        for r, actions in enumerate(schedule.actions):
            assert {a.stage for a in actions} == {r, 2 * k - 1 - r}
            assert sorted((a.op.value, a.stage, a.microbatch) for a in actions) == sorted(
                (op, j, i) for op in "FIW" for j in (r, 2 * k - 1 - r) for i in range(m)
            )


def test_warm_up_of_the_paper() -> None:
    """Rank r: 2(K-r)-1 forwards on the way down, r pairs (up, down), K-r (F I W) up."""
    schedule = zb_v(4, 8)
    head = " ".join(str(a) for a in schedule.actions[1][:17])
    assert head == "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6"


@pytest.mark.parametrize(
    "num_ranks, num_microbatches", [(1, 1), (2, 3), (2, 8), (3, 5), (4, 7), (4, 16), (8, 15), (8, 32)]
)
def test_bubble_is_only_the_first_input_s_way_down(num_ranks: int, num_microbatches: int) -> None:
    """The paper: zero bubble when F = I = W. Ours, per stage costs 1 (M >= 2K-1): every
    rank idles exactly K-1 ticks, the time the first micro-batch takes to reach the V's
    bottom (rank K-1 cannot start before): makespan 6M + K - 1, bubble (K-1)/(6M+K-1),
    3.0% at K = 4, M = 16. On the same model (each stage half of a ZB-H1 stage) that is
    half of ZB-H1's idle time and a sixth of 1F1B's."""
    k, m = num_ranks, num_microbatches
    result = simulate(zb_v(k, m), UNIFORM)
    assert result.idle == pytest.approx((k - 1,) * k)
    assert result.makespan == 6 * m + k - 1
    assert result.bubble_fraction == pytest.approx((k - 1) / (6 * m + k - 1))
    half = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
    ours = simulate(zb_v(k, m), half)
    assert ours.busy == pytest.approx(simulate(zb_h1(k, m), UNIFORM).busy)
    assert sum(ours.idle) * 2 == pytest.approx(sum(simulate(zb_h1(k, m), UNIFORM).idle))
    assert sum(ours.idle) * 6 == pytest.approx(sum(simulate(one_f_one_b(k, m), UNIFORM).idle))


def test_peak_memory_is_1f1b_s_on_every_rank() -> None:
    """The paper: 1F1B's activation memory. Ours: at most 2K stage-micro-batches in
    flight (F run, W not yet) on every rank, each half a 1F1B stage, i.e. K full stages:
    1F1B's peak (that of its first rank), now on every rank."""
    for k, m in sizes():
        peaks = simulate(zb_v(k, m)).peak_activations
        assert max(peaks) <= 2 * k
        if m >= 2 * k - 1:
            assert peaks == (2 * k,) * k
            assert max(simulate(one_f_one_b(k, m)).peak_activations) * 2 == 2 * k


def test_every_w_follows_its_i() -> None:
    for k, m in sizes():
        assert_each_w_after_its_i(zb_v(k, m))


def test_rejects_counts_below_one() -> None:
    with pytest.raises(ValueError, match="zb-v: num_ranks must be at least 1, got 0"):
        zb_v(0, 4)
