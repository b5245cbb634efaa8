from __future__ import annotations

import itertools

import pytest

from pipetrain.schedule import (
    Action,
    Op,
    dualpipe_v,
    render_grid,
    simulate,
    v_placement,
    validate,
    zb_v,
)

from .helpers import UNIFORM, assert_each_w_after_its_i, sizes


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(dualpipe_v(2, 4)) == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3\n"
        "rank 1: .   1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"
    )


def test_v_placement_and_one_backward_per_microbatch_on_the_grid() -> None:
    for k, m in sizes():
        schedule = dualpipe_v(k, m)
        validate(schedule)
        assert schedule.stage_to_rank == v_placement(k)
        assert_each_w_after_its_i(schedule)
        for r, actions in enumerate(schedule.actions):
            assert {a.stage for a in actions} == {r, 2 * k - 1 - r}


def _pairs(actions: tuple[Action, ...]) -> int:
    """Adjacent (F of one stage, B of the rank's other stage on another micro-batch)."""
    return sum(
        a.op is Op.FORWARD and b.op is Op.BACKWARD and a.stage != b.stage
        and a.microbatch != b.microbatch
        for a, b in itertools.pairwise(actions)
    )


@pytest.mark.parametrize("num_ranks, num_microbatches", [(1, 2), (2, 4), (3, 7), (4, 8), (4, 16)])
def test_forwards_paired_with_backwards_of_other_microbatches(
    num_ranks: int, num_microbatches: int
) -> None:
    """Rank r: 2(M-2K+r+1) pairs in the steady state (F down + B up, F up + B down) and
    K-r-1 in the phase after it; the rest of the backwards are split (I, W) in the tails."""
    k, m = num_ranks, num_microbatches
    schedule = dualpipe_v(k, m)
    for r, actions in enumerate(schedule.actions):
        assert _pairs(actions) == 2 * (m - 2 * k + r + 1) + (k - r - 1)
        full = sum(a.op is Op.BACKWARD for a in actions)
        split = sum(a.op is Op.BACKWARD_INPUT for a in actions)
        assert full + split == 2 * m and split == sum(a.op is Op.BACKWARD_WEIGHT for a in actions)
        assert split > 0


@pytest.mark.parametrize(
    "num_ranks, num_microbatches", [(1, 2), (2, 4), (2, 9), (3, 6), (4, 8), (4, 16), (8, 16), (8, 32)]
)
def test_bubble_is_zb_v_s(num_ranks: int, num_microbatches: int) -> None:
    """DualPipe's report gives DualPipe-V's bubble as (PP/2-1)(F&B + B - 3W) with
    PP = 2K stages; with F = I = W = 1, B = 2 and a pair costing F + B (no fused kernel)
    we get ZB-V's: every rank idles K-1 ticks, makespan 6M + K - 1 (M >= 2K)."""
    k, m = num_ranks, num_microbatches
    result = simulate(dualpipe_v(k, m), UNIFORM)
    assert result.idle == pytest.approx((k - 1,) * k)
    assert result.makespan == simulate(zb_v(k, m), UNIFORM).makespan == 6 * m + k - 1


def test_peak_memory_is_2k_plus_1() -> None:
    """The report: PP + 1 for DualPipe-V (PP = 2K stages): at most 2K + 1
    stage-micro-batches in flight on every rank, one more than ZB-V."""
    for k, m in sizes():
        peaks = simulate(dualpipe_v(k, m)).peak_activations
        assert max(peaks) <= 2 * k + 1
        if m >= 2 * k:
            assert peaks == (2 * k + 1,) * k


def test_rejects_counts_below_one() -> None:
    with pytest.raises(ValueError, match="dualpipe-v: num_microbatches must be at least 1, got 0"):
        dualpipe_v(2, 0)
