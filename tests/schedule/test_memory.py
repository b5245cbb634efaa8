"""Activation bytes per rank and stage: modes, offload budgets, every schedule."""

from __future__ import annotations

import pytest

from pipetrain.schedule import (
    StageBytes,
    activation_peaks,
    build_schedule,
    one_f_one_b,
    simulate,
    v_half,
    v_min,
    zb_h1,
    zb_v,
)
from pipetrain.schedule.registry import TRAINING_SCHEDULES, default_stages_per_rank


@pytest.mark.parametrize("name", [s for s in TRAINING_SCHEDULES if s not in ("pipedream", "2bw")])
def test_kept_whole_it_is_the_simulator_s_count_times_the_bytes(name: str) -> None:
    for k, m in ((2, 5), (4, 8)):
        schedule = build_schedule(name, num_ranks=k, num_microbatches=m,
                                  stages_per_rank=default_stages_per_rank(name))
        counts = simulate(schedule).peak_activations
        peaks = activation_peaks(schedule, [StageBytes(saved=6.0, input=1.0)] * schedule.num_stages)
        assert peaks.per_rank == tuple(7.0 * c for c in counts)


def test_rematerialized_stages_keep_their_inputs_and_one_rebuilt_micro_batch() -> None:
    schedule = one_f_one_b(4, 8)  # keeps 4, 3, 2, 1
    stages = [StageBytes(saved=100.0, input=1.0)] * 4
    always = activation_peaks(schedule, stages, modes=("always",) * 4)
    assert always.per_rank == (104.0, 103.0, 102.0, 101.0)
    # except_last: the last micro-batch (whose backward comes first) stays whole, and one
    # other is rebuilt meanwhile
    last = activation_peaks(schedule, stages, modes=("except_last",) * 4)
    assert last.per_rank == (204.0, 203.0, 202.0, 101.0)
    mixed = activation_peaks(schedule, stages, modes=("always", "always", "never", "never"))
    assert mixed.per_stage == (104.0, 103.0, 202.0, 101.0)
    selective = activation_peaks(schedule, [StageBytes(saved=100.0, input=1.0, selective=40.0)] * 4,
                                 modes=("selective",) * 4)
    assert selective.per_rank == (164.0, 123.0, 82.0, 41.0)
    # per layer: each kept micro-batch holds its layers' inputs (5), and a running backward
    # the largest layer's rebuilt activations (25) on top
    layered = [StageBytes(saved=100.0, input=1.0, layer_inputs=5.0, layer_saved=25.0)] * 4
    per_layer = activation_peaks(schedule, layered, modes=("per_layer",) * 4)
    assert per_layer.per_rank == (45.0, 40.0, 35.0, 30.0)
    assert activation_peaks(schedule, layered, modes=("per_layer", "never", "always", "always")
                            ).per_stage == (45.0, 303.0, 102.0, 101.0)


def test_an_offload_budget_caps_what_a_stage_keeps_on_its_device() -> None:
    schedule = zb_h1(2, 6)  # every rank keeps 2 (F to W)
    stages = [StageBytes(saved=10.0)] * 2
    assert activation_peaks(schedule, stages).per_stage == (20.0, 20.0)
    capped = activation_peaks(schedule, stages, offload=(0.0, None))
    # stage 0 keeps none beyond the micro-batch whose backward is running
    assert capped.per_stage == (10.0, 20.0)
    assert activation_peaks(schedule, stages, offload=(15.0, 15.0)).per_stage == (20.0, 20.0)
    assert activation_peaks(schedule, stages, offload=(5.0, 5.0)).per_stage == (15.0, 15.0)


@pytest.mark.parametrize("k", [2, 4])
def test_v_schedules_in_bytes_against_1f1b(k: int) -> None:
    """The same model cut in K stages (1F1B) or 2K half stages (the V schedules)."""
    m = 4 * k
    full = activation_peaks(one_f_one_b(k, m), [StageBytes(saved=2.0)] * k).per_rank
    half = [StageBytes(saved=1.0)] * (2 * k)
    assert max(activation_peaks(zb_v(k, m), half).per_rank) == max(full)
    assert max(activation_peaks(v_half(k, m), half).per_rank) == 0.5 * max(full)
    assert max(activation_peaks(v_min(k, m), half).per_rank) <= (0.5 if k == 2 else 0.4) * max(full)


def test_one_entry_per_stage() -> None:
    with pytest.raises(ValueError, match="the schedule has 2 stages, got 1 stage sizes"):
        activation_peaks(one_f_one_b(2, 2), [StageBytes(saved=1.0)])


def test_a_running_backward_adds_its_workspace_to_what_its_rank_holds() -> None:
    """1F1B on 2 ranks: rank 0 holds 2 micro-batches when its first B runs (the peak);
    a whole backward adds ``workspace``, an input-gradient pass ``input_workspace``."""
    held = StageBytes(saved=10.0)
    plain = activation_peaks(one_f_one_b(2, 4), [held] * 2).per_rank
    assert plain == (20.0, 10.0)
    busy = StageBytes(saved=10.0, workspace=3.0, input_workspace=5.0)
    assert activation_peaks(one_f_one_b(2, 4), [busy] * 2).per_rank == (23.0, 13.0)
    split = activation_peaks(zb_h1(2, 4), [busy] * 2).per_rank
    assert split == tuple(p + 5.0 for p in activation_peaks(zb_h1(2, 4), [held] * 2).per_rank)
