"""Deferred batch norm in GPipe: running statistics of the whole mini-batch.

Each micro-batch is normalized by its own statistics (as in GPipe), but the running
mean, variance and ``num_batches_tracked`` equal those that ``nn.BatchNorm`` stores
after seeing the whole mini-batch at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close
from pipetrain.batchnorm import DeferredBatchNorm


def model(momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.Tanh(),
        nn.Conv2d(4, 2, 1),
        nn.BatchNorm2d(2, momentum=momentum),
    )


class InputRecorder:
    """Records the inputs each batch norm sees in its (first, tracked) forwards."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.inputs: dict[int, list[torch.Tensor]] = {id(m): [] for m in modules}
        for m in modules:
            m.register_forward_hook(self.hook)

    def hook(self, module: nn.Module, args: tuple[torch.Tensor], output: torch.Tensor) -> None:
        if not pipetrain.is_recomputing():
            self.inputs[id(module)].append(args[0].detach().clone())


def reference_stats(bn: DeferredBatchNorm, initial: nn.Module, inputs: list[torch.Tensor],
                    num_steps: int) -> nn.Module:
    """A plain batch norm that saw the same data, one whole mini-batch per step."""
    ref = copy.deepcopy(initial).train()
    per_step = len(inputs) // num_steps
    for step in range(num_steps):
        ref(torch.cat(inputs[step * per_step : (step + 1) * per_step]))
    return ref


def assert_same_stats(actual: nn.Module, expected: nn.Module) -> None:
    assert_close(actual.running_mean, expected.running_mean, what="running_mean")
    assert_close(actual.running_var, expected.running_var, what="running_var")
    assert int(actual.num_batches_tracked) == int(expected.num_batches_tracked)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("batch", [8, 10, 3], ids=lambda b: f"batch{b}")
def test_running_stats_equal_full_batch_batch_norm(checkpoint, batch):
    plain = model()
    initial = copy.deepcopy(plain)
    gpipe = pipetrain.GPipe(copy.deepcopy(plain), [2, 3, 3], chunks=4, checkpoint=checkpoint,
                            deferred_batch_norm=True)
    bns = [m for m in gpipe.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(bns) == 3
    recorder = InputRecorder(bns)
    torch.manual_seed(1)
    steps = [torch.randn(batch, 3, 6, 6) for _ in range(2)]
    for x in steps:
        gpipe(x).sum().backward()
        plain(x)
    # the first batch norm sees the same input as in the plain model
    assert_same_stats(bns[0], plain[1])
    # later ones see micro-batch-normalized inputs: compare with a plain batch norm fed
    # the same inputs as whole mini-batches
    for bn, index in zip(bns, [1, 4, 7]):
        inputs = recorder.inputs[id(bn)]
        assert len(inputs) == 2 * min(4, batch)  # one per micro-batch, never recomputed
        assert_same_stats(bn, reference_stats(bn, initial[index], inputs, num_steps=2))
    assert int(bns[0].num_batches_tracked) == 2


def test_cumulative_average_momentum_none():
    plain = model(momentum=None)
    gpipe = pipetrain.GPipe(copy.deepcopy(plain), [2, 6], chunks=4, deferred_batch_norm=True)
    for _ in range(3):
        x = torch.randn(8, 3, 6, 6)
        gpipe(x).sum().backward()
        plain(x)
    assert_same_stats(gpipe[1], plain[1])


def test_no_grad_training_forward_tracks_like_batch_norm():
    plain = model()
    gpipe = pipetrain.GPipe(copy.deepcopy(plain), [2, 6], chunks=4, deferred_batch_norm=True)
    x = torch.randn(3, 3, 6, 6)  # fewer rows than chunks
    with torch.no_grad():
        gpipe(x)
        plain(x)
    assert_same_stats(gpipe[1], plain[1])


def test_eval_mode_uses_and_keeps_the_running_stats():
    gpipe = pipetrain.GPipe(model(), [2, 6], chunks=4, deferred_batch_norm=True)
    x = torch.randn(8, 3, 6, 6)
    gpipe(x).sum().backward()
    gpipe.eval()
    unpipelined = nn.Sequential(*gpipe)  # the same layers, with the same statistics
    before = gpipe[1].running_mean.clone()
    assert_close(gpipe(x), unpipelined(x))
    assert torch.equal(gpipe[1].running_mean, before)
    assert int(gpipe[1].num_batches_tracked) == 1


def test_without_deferred_batch_norm_the_layers_stay_plain():
    gpipe = pipetrain.GPipe(model(), [2, 6], chunks=4)
    assert not any(isinstance(m, DeferredBatchNorm) for m in gpipe.modules())
    assert type(gpipe[1]) is nn.BatchNorm2d
