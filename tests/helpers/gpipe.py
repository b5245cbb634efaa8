"""Helpers of the GPipe tests: plain-PyTorch references and scaled comparisons."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import pipetrain

RTOL = 1e-6
"""Largest difference allowed, relative to the scale of the expected values (float32)."""


def assert_close(actual: Any, expected: Any, *, rtol: float = RTOL, what: str = "") -> None:
    """``max |actual - expected| <= rtol * max(1, max |expected|)`` (both ``None`` passes)."""
    if expected is None:
        assert actual is None, f"{what}: expected None, got {actual!r}"
        return
    assert actual is not None, f"{what}: got None"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    diff = (actual.detach() - expected.detach()).abs().max().item() if expected.numel() else 0.0
    assert diff <= rtol * scale, f"{what}: max abs diff {diff:.3g} > {rtol:g} * {scale:.3g}"


def assert_grads_close(actual: Iterable[nn.Parameter], expected: Iterable[nn.Parameter],
                       *, rtol: float = RTOL) -> None:
    """Parameter gradients of two models with the same layers agree, in order."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a.grad, e.grad, rtol=rtol, what=f"grad of parameter {index}")


def mlp(seed: int = 0, *, width: int = 8, num_layers: int = 6) -> nn.Sequential:
    """A small MLP of ``num_layers`` children (linear, activations, a layer norm)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(5, width)]
    kinds: list[Callable[[], nn.Module]] = [
        nn.Tanh, lambda: nn.Linear(width, width), nn.GELU, lambda: nn.LayerNorm(width),
        lambda: nn.Linear(width, width), nn.Sigmoid,
    ]
    while len(layers) < num_layers:
        layers.append(kinds[(len(layers) - 1) % len(kinds)]())
    return nn.Sequential(*layers)


def pipelined(model: nn.Sequential, balance: list[int], **kwargs: Any) -> pipetrain.GPipe:
    """A GPipe over a deep copy of ``model`` (the original stays the reference)."""
    return pipetrain.GPipe(copy.deepcopy(model), balance, **kwargs)


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh leaf copy requiring grad."""
    return tensor.detach().clone().requires_grad_(True)
