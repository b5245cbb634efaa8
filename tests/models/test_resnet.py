"""Tests of pipetrain.models.resnet."""

from __future__ import annotations

import pickle

import pytest
import torch

from pipetrain.models.resnet import (
    Classifier,
    Pool,
    ResidualBlock,
    ResNetConfig,
    Stem,
    build_resnet,
    resnet_layer,
    resnet_layer_factories,
)

SMALL = ResNetConfig(widths=(8, 16), num_blocks=2)


def test_layer_sequence_and_shapes() -> None:
    model = build_resnet(SMALL, seed=0)
    assert [type(layer) for layer in model] == [
        Stem,
        ResidualBlock,
        ResidualBlock,
        ResidualBlock,
        ResidualBlock,
        Pool,
        Classifier,
    ]
    shapes = []
    x = torch.randn(2, 3, 32, 32)
    for layer in model:
        x = layer(x)
        shapes.append(tuple(x.shape))
    assert shapes == [
        (2, 8, 32, 32),
        (2, 8, 32, 32),
        (2, 8, 32, 32),
        (2, 16, 16, 16),
        (2, 16, 16, 16),
        (2, 16),
        (2, 10),
    ]


def test_default_config_classifies_cifar_sized_images() -> None:
    model = build_resnet(ResNetConfig(norm="group"), seed=0)
    assert len(model) == 9
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_factories_are_deterministic_and_match_build() -> None:
    factories = resnet_layer_factories(SMALL, seed=4)
    torch.randn(10)
    layers = [factory() for factory in pickle.loads(pickle.dumps(factories))[::-1]][::-1]
    for built, layer in zip(build_resnet(SMALL, seed=4), layers):
        for (name, a), (_, b) in zip(built.state_dict().items(), layer.state_dict().items()):
            assert torch.equal(a, b), name
    assert not torch.equal(layers[1].conv_1.weight, layers[2].conv_1.weight)


def test_group_norm_makes_samples_independent() -> None:
    model = build_resnet(ResNetConfig(widths=(8,), num_blocks=1, norm="group"), seed=0).train()
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(model(x)[:2], model(x[:2]))


def test_config_and_index_errors() -> None:
    with pytest.raises(ValueError) as info:
        ResNetConfig(widths=(), num_blocks=0, norm="layer")
    message = str(info.value)
    assert "widths=()" in message and "num_blocks=0" in message and "norm='layer'" in message
    with pytest.raises(ValueError, match=r"index=7 is out of range.*layers 0\.\.6"):
        resnet_layer(SMALL, seed=0, index=7)
