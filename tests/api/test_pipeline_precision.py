"""Pipeline under mixed precision equals single-process training under the same autocast;
fp16's loss scale follows torch.amp.GradScaler, and an overflow on one stage of one
replica skips the step on every rank.

Tolerance: the pipeline runs, per micro-batch, the very ops of the single-process run
(same shapes, same autocast dtype, the loss weighted by the micro-batch's share), so the
only freedom left is the order in which the float32 weight gradients of the micro-batches
are summed (a replicated stage sums its replicas' gradients in the all-reduce). That
order changes a float32 sum by a few units in its last place, so the weights' updates
(final minus initial weights) must agree within 1e-5 of their norm, layer by layer, and
the losses within 1e-5 relative: the float32 tolerance of the other correctness tests,
far tighter than bf16's resolution (2^-8). Autocast itself changes the updates of this
model by about 1e-2 (bf16) and 1e-3 (fp16) of their norm, checked to exceed 10x the
tolerance, so a pipeline that ignored autocast would fail. (On this machine the two runs
agree bit for bit.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.precision_jobs import POISONED_STEP, STEPS, pipeline_job, reference
from pipetrain.api.config import PipelineConfig
from pipetrain.runtime.precision import LossScaling

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
LAYOUT = {"num_stages": 2, "stage_replicas": (1, 2), "num_microbatches": 4}
"""Stage 0 on rank 0; stage 1 replicated on ranks 1 and 2."""
CONFIGS = [
    {**LAYOUT, "schedule": "1f1b", "mixed_precision": "bf16"},
    {**LAYOUT, "schedule": "gpipe", "checkpoint": "always", "mixed_precision": "bf16"},
    {**LAYOUT, "schedule": "gpipe", "checkpoint": "per_layer", "mixed_precision": "bf16"},
    {**LAYOUT, "schedule": "1f1b", "checkpoint": "except_last", "mixed_precision": "fp16"},
    {**LAYOUT, "schedule": "1f1b", "mixed_precision": "fp16", "poison": True},
]


def _update_difference(weights: dict[str, torch.Tensor], expected: dict[str, Any]) -> float:
    """Largest ``|w - w_expected| / |w_expected - w_initial|`` over the layers."""
    assert sorted(weights) == sorted(expected["weights"])
    return max(((weights[k] - expected["weights"][k]).norm()
                / (expected["weights"][k] - expected["initial"][k]).norm()).item() for k in weights)


def test_mixed_precision_matches_single_process_and_overflows_skip_everywhere() -> None:
    outcome = run_workers(pipeline_job, 3, [dict(c) for c in CONFIGS], [2], timeout=300)
    float32 = reference(None, 4, poison=False)
    for index, config in enumerate(CONFIGS):
        precision, poison = str(config["mixed_precision"]), bool(config.get("poison"))
        expected = reference(precision, 4, poison=poison)
        # autocast changes the result far beyond the tolerance: matching shows it ran
        assert _update_difference(float32["weights"], expected) > 10 * TOLERANCE
        merged: dict[str, torch.Tensor] = {}
        for rank, results in enumerate(outcome):
            got = results[index]
            merged.update(got["weights"])
            assert got["losses"] == pytest.approx(expected["losses"], rel=TOLERANCE), (config, rank)
            if precision == "fp16":  # the scale of every rank follows GradScaler's
                assert got["scales"] == expected["scales"], (config, rank)
            skipped = [poison and step == POISONED_STEP for step in range(STEPS)]
            assert got["skipped"] == skipped, (config, rank)
            # no rank applied the skipped update, though only rank 2's gradient overflowed
            assert got["changed"] == [not s for s in skipped], (config, rank)
        assert _update_difference(merged, expected) <= TOLERANCE, config
    scales = outcome[0][next(i for i, c in enumerate(CONFIGS) if c.get("poison"))]["scales"]
    assert scales[POISONED_STEP] == scales[POISONED_STEP - 1] / 2  # the overflow backed off


def test_mixed_precision_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='fp8' is not a mixed precision; choose 'bf16'"):
        PipelineConfig(mixed_precision="fp8")
    with pytest.raises(ValueError, match=r"only fp16 scales the loss"):
        PipelineConfig(mixed_precision="bf16", loss_scaling=LossScaling())
    with pytest.raises(ValueError, match=r"backoff_factor=2.0\) must be between 0 and 1"):
        PipelineConfig(mixed_precision="fp16", loss_scaling=LossScaling(backoff_factor=2.0))
