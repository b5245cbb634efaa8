from __future__ import annotations

import pytest

from pipetrain.schedule import Op, one_f_one_b, render_grid, simulate, zb_h1

from .helpers import UNIFORM, full_activation_peaks, sizes


def test_grid_is_the_docstring_table() -> None:
    assert render_grid(zb_h1(3, 4)) == (
        "rank 0: F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3\n"
        "rank 1: .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3\n"
        "rank 2: .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"
    )


def test_same_warmup_as_1f1b_and_each_w_after_its_i() -> None:
    for num_stages, num_microbatches in sizes():
        schedule = zb_h1(num_stages, num_microbatches)
        reference = one_f_one_b(num_stages, num_microbatches)
        for ours, theirs in zip(schedule.actions, reference.actions):
            warmup = [
                a for a in theirs[: theirs.index(next(a for a in theirs if a.op is Op.BACKWARD))]
            ]
            assert list(ours[: len(warmup)]) == warmup
            position = {(a.op, a.microbatch): p for p, a in enumerate(ours)}
            for i in range(num_microbatches):
                assert (
                    position[(Op.FORWARD, i)]
                    < position[(Op.BACKWARD_INPUT, i)]
                    < position[(Op.BACKWARD_WEIGHT, i)]
                )


@pytest.mark.parametrize(
    "num_stages, num_microbatches",
    [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32)],
)
def test_bubble_is_a_third_of_1f1b(num_stages: int, num_microbatches: int) -> None:
    """With F = I = W = 1 (M >= K), each rank idles K-1 instead of 1F1B's 3(K-1).

    The bubble *time* is exactly a third; the bubble *fraction* ratio is
    (3M + 3K - 3) / (3 (3M + K - 1)), a bit above a third (0.37 at M = 4K), since the
    makespan shrinks with the bubble.
    """
    base = simulate(one_f_one_b(num_stages, num_microbatches), UNIFORM)
    result = simulate(zb_h1(num_stages, num_microbatches), UNIFORM)
    k, m = num_stages, num_microbatches
    assert result.idle == pytest.approx([k - 1] * k)
    assert base.idle == pytest.approx([3 * (k - 1)] * k)
    assert result.makespan == 3 * m + k - 1
    ratio = result.bubble_fraction / base.bubble_fraction
    assert ratio == pytest.approx((3 * m + 3 * k - 3) / (3 * (3 * m + k - 1)))
    if m >= 4 * k:
        assert ratio == pytest.approx(1 / 3, abs=0.05)


def test_peak_memory_is_1f1b_s() -> None:
    """1F1B's peak in flight (that of stage 0, min(K, M)) on every stage; per stage the
    full activations (F run, I not yet) are 1F1B's exactly."""
    for num_stages, num_microbatches in sizes():
        ours = zb_h1(num_stages, num_microbatches)
        theirs = one_f_one_b(num_stages, num_microbatches)
        peaks = simulate(ours).peak_activations
        assert (
            max(peaks)
            == max(simulate(theirs).peak_activations)
            == min(num_stages, num_microbatches)
        )
        assert full_activation_peaks(ours) == full_activation_peaks(theirs)


def test_rejects_counts_below_one() -> None:
    with pytest.raises(ValueError, match="zb-h1: num_microbatches must be at least 1, got 0"):
        zb_h1(4, 0)
