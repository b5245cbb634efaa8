"""Tests for pipetrain.partition.balance and .profile (both on the CPU)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import pipetrain.balance
from pipetrain.models.unet import unet
from pipetrain.partition import balance_by_size, balance_by_time, profile_sizes, profile_times
from pipetrain.skip import current_skip_tracker

CPU = torch.device("cpu")


class Sleep(nn.Module):
    """A slow layer: sleeps in forward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class Huge(nn.Module):
    """A cheap layer with a large parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.zeros(512, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table[0, :16]


def small(n: int) -> list[nn.Module]:
    return [nn.Linear(16, 16) for _ in range(n)]


def test_balance_by_time_isolates_a_slow_layer():
    model = nn.Sequential(*small(1), Sleep(0.03), *small(4))
    balance = balance_by_time(3, model, torch.randn(8, 16), timeout=0.3, device="cpu")
    assert balance == [1, 1, 4]


def test_balance_by_time_gives_a_valid_balance():
    model = nn.Sequential(*small(7))
    balance = balance_by_time(3, model, torch.randn(4, 16), timeout=0.0, device=CPU)
    assert len(balance) == 3 and sum(balance) == 7 and min(balance) >= 1


def test_balance_by_size_puts_a_huge_layer_alone():
    model = nn.Sequential(*small(2), Huge(), *small(2))
    assert balance_by_size(3, model, torch.randn(8, 16), chunks=2, device="cpu") == [2, 1, 2]


def test_profile_sizes_counts_new_activations_per_sample_and_scaled_parameters():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5))
    x = torch.randn(8, 16, requires_grad=True)
    one = profile_sizes(model, x, chunks=1, param_scale=3.0, device=CPU)
    two = profile_sizes(model, x, chunks=2, param_scale=3.0, device=CPU)
    params = (16 * 16 + 16) * 4
    block = 512  # one sample's 64-byte row, in a CUDA allocation block
    # Linear: its output (its input existed before; the weight is a parameter); ReLU:
    # its output, which it saves; Dropout: its output and its mask - per sample, times
    # the rows of one micro-batch (8 / chunks)
    assert one == [8 * block + 3 * params, 8 * block, 8 * 2 * block]
    assert two == [4 * block + 3 * params, 4 * block, 4 * 2 * block]


def test_profile_sizes_of_a_layer_that_needs_two_samples():
    # BatchNorm1d cannot train on one (1, C) sample (torchgpipe's profiler fails on
    # it): the model is weighed on two samples, per sample
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    sizes = profile_sizes(model, torch.randn(8, 16), chunks=2, param_scale=2.0, device=CPU)
    params = (16 * 16 + 16) * 4
    assert sizes[0] == 4 * 512 // 2 + 2 * params  # two rows (128 bytes) in one block, halved
    assert sizes[1] > 2 * 2 * 16 * 4  # its output and saved statistics, and its parameters


def test_profile_times_measures_every_layer():
    model = nn.Sequential(Sleep(0.01), nn.Linear(16, 16))
    times = profile_times(model, torch.randn(2, 16), timeout=0.0, device=CPU)
    assert len(times) == 2 and times[0] >= 0.01 and 0 <= times[1] < 0.01


def test_profiling_leaves_the_module_untouched():
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.1))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    balance_by_time(2, model, torch.randn(8, 16), timeout=0.0, device="cpu")
    balance_by_size(2, model, torch.randn(8, 16), device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training and not model[1].training


def test_in_place_layers_run_and_do_not_change_the_sample():
    class DoubleInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)

    model = nn.Sequential(DoubleInPlace(), nn.Linear(16, 16), nn.ReLU(inplace=True))
    sample = torch.ones(4, 16)
    balance_by_time(2, model, sample, timeout=0.05, device="cpu")
    balance_by_size(2, model, sample, device="cpu")
    assert torch.equal(sample, torch.ones(4, 16))


def test_balancing_a_model_with_skip_connections():
    model = unet(depth=2, channels=4)
    x = torch.randn(2, 3, 8, 8)
    for balance in (
        balance_by_time(3, model, x, timeout=0.0, device="cpu"),
        balance_by_size(3, model, x, chunks=2, device="cpu"),
    ):
        assert len(balance) == 3 and sum(balance) == len(model)
    assert len(current_skip_tracker()) == 0  # every stashed skip was popped


def test_nested_batches_are_profiled():
    class TakeX(nn.Module):
        def forward(self, batch: dict) -> torch.Tensor:
            return batch["x"] * batch["scale"]

    model = nn.Sequential(TakeX(), nn.Linear(16, 16))
    sample = {"x": torch.randn(4, 16), "scale": 2.0}
    assert sum(balance_by_time(2, model, sample, timeout=0.0, device="cpu")) == 2
    assert sum(balance_by_size(2, model, sample, device="cpu")) == 2


def test_torchgpipe_style_alias():
    assert pipetrain.balance.balance_by_time is balance_by_time
    assert pipetrain.balance.balance_by_size is balance_by_size


@pytest.mark.parametrize(
    ("partitions", "error", "message"),
    [
        (0, ValueError, r"partitions must be a positive integer \(0 < 1\); fix"),
        (4, ValueError, r"sequence is shorter than intended partitions \(3 < 4\): the module "
                        r"has 3 layers .*; fix: balance_by_time\(3, model, sample\)"),
        (1.0, TypeError, r"positive integer \(the number of partitions\), got 1.0 \(float\)"),
    ],
)
def test_bad_partition_counts(partitions, error, message):
    model = nn.Sequential(*small(3))
    with pytest.raises(error, match=message):
        balance_by_time(partitions, model, torch.randn(2, 16), timeout=0.0, device="cpu")
    with pytest.raises(error, match=message):
        balance_by_size(partitions, model, torch.randn(2, 16), device="cpu")
    with pytest.raises(TypeError, match=r"must be nn\.Sequential"):
        balance_by_size(1, nn.Linear(16, 16), torch.randn(2, 16), device="cpu")
