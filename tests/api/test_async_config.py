"""``PipelineConfig`` with an asynchronous schedule: what it cannot do is refused, every
problem at once, each saying which setting, why, and the fix (no processes needed)."""

from __future__ import annotations

import pytest

from pipetrain.api.config import PipelineConfig


def test_async_schedules_accept_what_they_can_do() -> None:
    for schedule in ("pipedream", "2bw", "PipeDream-2BW"):
        config = PipelineConfig(schedule=schedule, nonfinite="ignore", checkpoint="always",
                                num_stages=2, stage_replicas=(2, 1))
        assert config.world_size == 3
    assert PipelineConfig(schedule="pipedream", vertical_sync=True, nonfinite="ignore").vertical_sync


def test_everything_an_async_schedule_cannot_do_is_named_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        PipelineConfig(schedule="pipedream", clip_grad_norm=1.0, nonfinite="skip",
                       checkpoint="except_last", deferred_batch_norm=True, vertical_sync=True,
                       num_stages=2, stage_replicas=(2, 1))
    text = str(caught.value)
    for phrase in (
        "clip_grad_norm=1.0: schedule 'pipedream' updates each stage on its own",
        "fix: clip_grad_norm=None",
        "nonfinite='skip': schedule 'pipedream' cannot refuse or skip a step whole",
        "fix: nonfinite='ignore'",
        "checkpoint='except_last' spares the micro-batch whose backward comes first after a flush",
        "deferred_batch_norm=True commits batch-norm statistics once per step",
        "vertical_sync=True needs the same replica count on every stage, got stage_replicas=(2, 1)",
    ):
        assert phrase in text, (phrase, text)


def test_vertical_sync_belongs_to_pipedream() -> None:
    with pytest.raises(ValueError, match=r"vertical_sync=True is an option of schedule 'pipedream'; "
                                         r"fix: schedule='pipedream' or vertical_sync=False"):
        PipelineConfig(schedule="2bw", vertical_sync=True, nonfinite="ignore")
    with pytest.raises(ValueError, match="vertical_sync='yes' must be True or False"):
        PipelineConfig(schedule="pipedream", vertical_sync="yes", nonfinite="ignore")  # type: ignore[arg-type]


def test_the_default_nonfinite_policy_is_named_with_its_fix() -> None:
    with pytest.raises(ValueError, match=r"nonfinite='error': schedule '2bw' cannot refuse"):
        PipelineConfig(schedule="2bw")


def test_several_stages_per_rank_are_refused() -> None:
    with pytest.raises(ValueError, match=r"stages_per_rank=2 needs an interleaved schedule"):
        PipelineConfig(schedule="pipedream", stages_per_rank=2, nonfinite="ignore")


def test_fp16_loss_scaling_is_refused_and_bf16_accepted() -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='fp16'.*fix: mixed_precision='bf16'"):
        PipelineConfig(schedule="2bw", nonfinite="ignore", mixed_precision="fp16")
    assert PipelineConfig(schedule="pipedream", nonfinite="ignore",
                          mixed_precision="bf16").mixed_precision == "bf16"
