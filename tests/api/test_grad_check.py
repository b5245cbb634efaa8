"""The step check's gradient norm in one process: exact enough, any precision, any layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipetrain.api.grad_check import check_gradients

CPU = torch.device("cpu")


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    return params


def test_the_norm_equals_a_float64_reference_for_float32_and_bfloat16_gradients() -> None:
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(1024, 1024, generator=generator) * 1e-3,
             torch.randn(1000, generator=generator) * 10.0,
             torch.randn(64, 64, generator=generator).to(torch.bfloat16)]
    reference = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    check = check_gradients(_params(*grads), loss_finite=True, replicas=1, device=CPU)
    assert abs(check.grad_norm - reference) < 1e-6 * reference
    assert check.finite


def test_the_norm_does_not_depend_on_how_the_gradients_are_grouped_into_stages() -> None:
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(300, 200, generator=generator) for _ in range(6)]
    whole = check_gradients(_params(*grads), loss_finite=True, replicas=1, device=CPU).grad_norm
    halves = [check_gradients(_params(*part), loss_finite=True, replicas=1, device=CPU).grad_norm
              for part in (grads[:2], grads[2:])]
    assert abs(math.sqrt(halves[0] ** 2 + halves[1] ** 2) - whole) < 1e-9 * whole


def test_a_non_finite_gradient_or_loss_makes_the_step_non_finite() -> None:
    bad = torch.ones(10)
    bad[3] = float("inf")
    assert not check_gradients(_params(bad), loss_finite=True, replicas=1, device=CPU).finite
    nan = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    assert not check_gradients(_params(nan), loss_finite=True, replicas=1, device=CPU).finite
    good = torch.ones(10)
    assert not check_gradients(_params(good), loss_finite=False, replicas=1, device=CPU).finite
    halved = check_gradients(_params(good), loss_finite=True, replicas=2, device=CPU).grad_norm
    assert abs(halved - math.sqrt(10 / 2)) < 1e-6  # each replica adds half its stage's share
