"""Skip connections across partitions: a U-Net (stash / pop over several layers) in
GPipe matches the unpipelined model, with checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close, assert_grads_close, leaf
from pipetrain.models import unet
from pipetrain.skip import pop, skip_layout, skippable, stash

BALANCES = {2: [5, 6], 3: [2, 5, 4], 4: [2, 2, 4, 3]}


@pytest.mark.parametrize("num_partitions", [2, 3, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_unet_matches_the_unpipelined_model(num_partitions, checkpoint):
    model = unet(depth=2, channels=4)
    gpipe = pipetrain.GPipe(copy.deepcopy(model), BALANCES[num_partitions], chunks=3,
                            checkpoint=checkpoint)
    # some skip really crosses a partition boundary
    layout = skip_layout(gpipe.partitions)
    assert any(layout.crossing(j) for j in range(num_partitions - 1))
    generator = torch.Generator().manual_seed(num_partitions)
    x = torch.randn(5, 3, 8, 8, generator=generator)
    x_ref, x_pipe = leaf(x), leaf(x)
    expected, actual = model(x_ref), gpipe(x_pipe)
    assert_close(actual, expected, what="output")
    weights = torch.randn(expected.shape, generator=generator)
    (expected * weights).sum().backward()
    (actual * weights).sum().backward()
    # convolution gradients summed over 3 micro-batches instead of the whole batch differ
    # in float32 by a few 1e-6 of their scale (seen up to 4e-6 with random inputs)
    assert_close(x_pipe.grad, x_ref.grad, rtol=1e-5, what="input grad")
    assert_grads_close(gpipe.parameters(), model.parameters(), rtol=1e-5)


@skippable(stash=["carry"])
class Stash(nn.Module):
    def forward(self, x):
        yield stash("carry", x * 2)
        return x + 1


@skippable(pop=["carry"])
class Pop(nn.Module):
    def forward(self, x):
        carry = yield pop("carry")
        return x * carry


def test_skip_over_a_whole_partition_with_and_without_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Tanh(), Pop(),
                          nn.Linear(4, 2))
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 2, 2], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    with torch.no_grad():
        assert_close(gpipe(x), model(x))
    x_ref, x_pipe = leaf(x), leaf(x)
    model(x_ref).sum().backward()
    gpipe(x_pipe).sum().backward()
    assert_close(x_pipe.grad, x_ref.grad)
    assert_grads_close(gpipe.parameters(), model.parameters())
