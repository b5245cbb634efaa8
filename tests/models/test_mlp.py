"""Tests of pipetrain.models.mlp."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from pipetrain.models.mlp import build_mlp, mlp_layer_factories


@pytest.mark.parametrize(("activation", "module"), [("relu", nn.ReLU), ("gelu", nn.GELU)])
def test_layers_and_shapes(activation: str, module: type[nn.Module]) -> None:
    model = build_mlp(width=16, depth=3, activation=activation, seed=0)
    assert len(model) == 3
    for layer in model:
        assert isinstance(layer, nn.Sequential)
        assert isinstance(layer[0], nn.Linear) and layer[0].weight.shape == (16, 16)
        assert isinstance(layer[1], module)
    assert model(torch.randn(5, 16)).shape == (5, 16)


def test_factories_are_deterministic_and_picklable() -> None:
    factories = mlp_layer_factories(width=8, depth=4, seed=2)
    first = [factory()[0].weight for factory in factories]
    torch.randn(100)
    again = [factory()[0].weight for factory in pickle.loads(pickle.dumps(factories))[::-1]][::-1]
    built = build_mlp(width=8, depth=4, seed=2)
    for a, b, layer in zip(first, again, built):
        assert torch.equal(a, b)
        assert torch.equal(a, layer[0].weight)
    assert not torch.equal(first[0], first[1])


def test_bad_arguments_are_all_reported() -> None:
    with pytest.raises(ValueError) as info:
        mlp_layer_factories(width=0, depth=-2, activation="tanh", seed=0)
    message = str(info.value)
    assert (
        "width=0" in message
        and "depth=-2" in message
        and "'tanh' is not one of ['gelu', 'relu']" in message
    )
