"""The fp16 loss scale follows torch.amp.GradScaler step for step; settings are checked."""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime.precision import LossScaler, LossScaling, autocast_dtype, stage_autocast


def test_the_scale_follows_grad_scaler_through_overflows_and_growth() -> None:
    pattern = [True, True, False, True, True, True, False, False, True, True, True, True]
    settings = LossScaling(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
    ours = LossScaler(settings)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0,
                                        backoff_factor=0.25, growth_interval=3)
    weight = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([weight], lr=0.1)
    for finite in pattern:
        torch_scaler.scale((weight * (1.0 if finite else float("inf"))).sum()).backward()
        torch_scaler.step(opt)
        torch_scaler.update()
        opt.zero_grad()
        ours.update(finite=finite)
        assert ours.scale == torch_scaler.get_scale()
    restored = LossScaler(settings)
    restored.load_state_dict(ours.state_dict())
    assert (restored.scale, restored.growth_tracker) == (ours.scale, ours.growth_tracker)


def test_unscaling_divides_in_place() -> None:
    scaler = LossScaler(LossScaling(init_scale=8.0))
    grads = [torch.full((3,), 8.0), torch.full((2, 2), -16.0)]
    scaler.unscale_(grads)
    assert torch.equal(grads[0], torch.ones(3)) and torch.equal(grads[1], torch.full((2, 2), -2.0))


def test_bad_settings_and_precisions_are_named() -> None:
    with pytest.raises(ValueError) as caught:
        LossScaler(LossScaling(init_scale=-1.0, growth_factor=0.5))
    assert "init_scale=-1.0) must be a positive number" in str(caught.value)  # every problem
    assert "growth_factor=0.5) must be above 1" in str(caught.value)
    with pytest.raises(ValueError, match="mixed_precision='tf32' is not a mixed precision"):
        autocast_dtype("tf32")
    with stage_autocast(torch.device("cpu"), None):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
