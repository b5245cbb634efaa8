"""Tests of pipetrain.models.amoebanet: AmoebaNet-D as a flat sequence of cells."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import pipetrain
from pipetrain.models import AmoebaNetConfig, amoebanet_layer_factories, build_amoebanet
from pipetrain.models.amoebanet import Cell, Classifier, Stem

SMALL = AmoebaNetConfig(num_normal_cells=3, num_filters=16, norm="group")


def test_layer_sequence_and_shapes() -> None:
    model = build_amoebanet(SMALL, seed=0)
    assert [type(layer) for layer in model] == [Stem] + [Cell] * 7 + [Classifier]
    shapes = []
    x: object = torch.randn(2, 3, 64, 64)
    for layer in model:
        x = layer(x)
        shapes.append(tuple((x[0] if isinstance(x, tuple) else x).shape))
    # D=16: stem D/4 at H/2; reduction cells output 3x their filters, normal cells 4x
    assert shapes == [
        (2, 4, 32, 32),  # stem
        (2, 24, 16, 16),  # stem reduction: filters 8
        (2, 48, 8, 8),  # stem reduction: filters 16 = D
        (2, 64, 8, 8),  # normal
        (2, 96, 4, 4),  # reduction: 2D
        (2, 128, 4, 4),  # normal
        (2, 192, 2, 2),  # reduction: 4D
        (2, 256, 2, 2),  # normal
        (2, 10),  # classifier
    ]
    assert SMALL.num_layers == len(model) == 9


def test_a_cell_hands_its_input_on_as_the_next_cells_second_input() -> None:
    model = build_amoebanet(SMALL, seed=0)
    stem_out = model[0](torch.randn(2, 3, 32, 32))
    output, before = model[1](stem_out)
    assert before is stem_out
    output_2, before_2 = model[2]((output, before))
    assert before_2 is output and output_2.shape[-1] == output.shape[-1] // 2


def test_factories_are_deterministic_and_match_build() -> None:
    factories = amoebanet_layer_factories(SMALL, seed=3)
    torch.randn(10)  # the global generator's state does not matter
    layers = [factory() for factory in pickle.loads(pickle.dumps(factories))[::-1]][::-1]
    for built, layer in zip(build_amoebanet(SMALL, seed=3), layers, strict=True):
        for (name, a), (_, b) in zip(built.state_dict().items(), layer.state_dict().items(),
                                     strict=True):
            assert torch.equal(a, b), name
    other = build_amoebanet(SMALL, seed=4)
    assert not torch.equal(layers[3].project[1].weight, other[3].project[1].weight)


def test_gradients_reach_every_parameter() -> None:
    model = build_amoebanet(SMALL, seed=0)
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_pipetrain_gpipe_matches_the_unpipelined_model(checkpoint: str) -> None:
    # cuts between cells: the (output, previous output) pair crosses each cut
    tiny = dataclasses.replace(SMALL, num_filters=8)
    reference = build_amoebanet(tiny, seed=0)
    pipe = pipetrain.GPipe(build_amoebanet(tiny, seed=0), [2, 3, 4], chunks=3,
                           checkpoint=checkpoint)
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    expected, output = reference(x), pipe(x)
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)
    expected.square().sum().backward()
    output.square().sum().backward()
    # float sums in another order (per micro-batch): tolerances relative to the largest
    # gradient, as a bias before a norm layer has a gradient of rounding errors only
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    for (name, a), b in zip(reference.named_parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_config_errors_name_every_bad_value_and_the_image_size_is_checked() -> None:
    with pytest.raises(ValueError) as info:
        AmoebaNetConfig(num_normal_cells=4, num_filters=12, norm="layer")
    message = str(info.value)
    assert "num_normal_cells=4 must be a multiple of 3" in message
    assert "num_filters=12 must be a multiple of 8" in message and "norm='layer'" in message
    with pytest.raises(ValueError, match="num_classes=0 must be a positive int"):
        AmoebaNetConfig(num_classes=0)
    model = build_amoebanet(SMALL, seed=0)
    with pytest.raises(ValueError, match=r"multiples of 32, got shape \(1, 3, 40, 64\).*32 x 64"):
        model(torch.randn(1, 3, 40, 64))
