"""Tests for pipetrain.models.unet: a U-Net built from skippable layers."""

from __future__ import annotations

import pytest
import torch

from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.models.unet import unet
from pipetrain.skip import Skippable, skip_layout, verify_skippables


def test_shape_and_layers():
    model = unet(depth=2, channels=8)
    assert len(model) == 11
    assert [name for name, _ in model.named_children()] == [
        "stem", "down0", "encode0", "down1", "encode1", "bottleneck",
        "up1", "merge1", "up0", "merge0", "head",
    ]
    assert model(torch.randn(2, 3, 16, 12)).shape == (2, 3, 16, 12)
    assert len(unet(depth=3, channels=2, out_channels=1)) == 15
    verify_skippables(model)


def test_skips_cross_several_layers():
    model = unet(depth=2, channels=2)
    layout = skip_layout([model[i : i + 1] for i in range(len(model))])  # one layer per stage
    spans = sorted(route.pop_stage - route.stash_stage for route in layout.routes)
    assert spans == [4, 8]
    assert sum(isinstance(layer, Skippable) for layer in model) == 4


def test_deterministic_given_a_seed_without_touching_global_rng():
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a, b, c = unet(seed=3), unet(seed=3), unet(seed=4)
    assert torch.equal(torch.rand(1), expected_next)
    x = torch.randn(1, 3, 8, 8)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), c(x))


def test_gradients_reach_every_parameter():
    model = unet(depth=2, channels=2)
    model(torch.randn(2, 3, 8, 8)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_skip_carries_the_signal_when_the_main_path_is_cut():
    model = unet(depth=1, channels=2)
    merge_conv = model.merge0.module.conv[0]
    with torch.no_grad():
        merge_conv.weight[:, :2].zero_()  # the upsampled main path no longer counts
    x = torch.randn(1, 3, 4, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.abs().sum() > 0  # through stem -> down0's stash -> merge0's pop
    with torch.no_grad():
        merge_conv.weight[:, 2:].zero_()  # cut the skip too: nothing reaches the input
    x.grad = None
    model(x).sum().backward()
    assert x.grad.abs().sum() == 0


def test_batch_norm_option_converts_to_deferred():
    model = unet(depth=1, channels=2, batch_norm=True)
    model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    assert sum(isinstance(m, DeferredBatchNorm) for m in model.modules()) == 5
    assert model(torch.randn(4, 3, 4, 4)).shape == (4, 3, 4, 4)


def test_errors():
    with pytest.raises(ValueError, match=r"positive sizes, got \{'depth': 0\}"):
        unet(depth=0)
    with pytest.raises(ValueError, match=r"multiples of 4, got shape \(1, 3, 6, 8\).*8 x 8"):
        unet(depth=2, channels=2)(torch.randn(1, 3, 6, 8))
