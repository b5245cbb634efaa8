"""Tests for pipetrain.batchnorm: running statistics per mini-batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.checkpoint import checkpoint
from pipetrain.microbatch import split_batch


def assert_stats_equal(deferred: nn.Module, reference: nn.Module) -> None:
    assert torch.allclose(deferred.running_mean, reference.running_mean, atol=1e-6)
    assert torch.allclose(deferred.running_var, reference.running_var, atol=1e-5)
    assert int(deferred.num_batches_tracked) == int(reference.num_batches_tracked)


@pytest.mark.parametrize("use_checkpoint", [False, True])
@pytest.mark.parametrize("rows", [8, 10])  # even and uneven micro-batches (10 -> 3, 3, 2, 2)
def test_running_stats_match_full_batch_batchnorm(use_checkpoint, rows):
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3)
    deferred = DeferredBatchNorm(3, chunks=4)
    for step in range(2):
        x = torch.randn(rows, 3, 5, 5) * (step + 2) + step
        reference(x)
        outputs = []
        for chunk in split_batch(x, 4):
            chunk = chunk.requires_grad_()
            out = checkpoint(deferred, chunk) if use_checkpoint else deferred(chunk)
            outputs.append(out)
            # Each micro-batch is normalized by its own statistics.
            expected = nn.functional.batch_norm(chunk, None, None, training=True)
            assert torch.allclose(out, expected, atol=1e-5)
        # Backward recomputes the checkpointed micro-batches: must not be tracked again.
        torch.cat(outputs).sum().backward()
        assert_stats_equal(deferred, reference)
    assert int(deferred.num_batches_tracked) == 2


def test_cumulative_average_when_momentum_is_none():
    reference = nn.BatchNorm1d(4, momentum=None)
    deferred = DeferredBatchNorm(4, momentum=None, chunks=3)
    for _ in range(3):
        x = torch.randn(9, 4) * 3
        reference(x)
        for chunk in x.chunk(3):
            deferred(chunk)
    assert_stats_equal(deferred, reference)


def test_eval_mode_uses_running_statistics_and_tracks_nothing():
    deferred = DeferredBatchNorm(2, chunks=1)
    deferred(torch.randn(6, 2, 3) + 5)
    reference = nn.BatchNorm1d(2)
    reference.load_state_dict(deferred.state_dict())
    deferred.eval()
    reference.eval()
    x = torch.randn(4, 2, 3)
    assert torch.allclose(deferred(x), reference(x))
    assert int(deferred.num_batches_tracked) == 1


def test_commit_for_a_step_with_fewer_micro_batches():
    deferred = DeferredBatchNorm(2, chunks=4)
    x = torch.randn(3, 2, 4)  # split in 4 gives only 3 micro-batches; track 2 of them
    for chunk in split_batch(x, 4)[:2]:
        deferred(chunk)
    assert int(deferred.num_batches_tracked) == 0
    deferred.commit()
    reference = nn.BatchNorm1d(2)
    reference(x[:2])
    assert_stats_equal(deferred, reference)
    deferred.commit()  # nothing tracked: no-op
    assert int(deferred.num_batches_tracked) == 1


def test_state_dict_matches_batchnorm_and_loads_torchgpipe_state():
    torchgpipe_batchnorm = pytest.importorskip("torchgpipe.batchnorm")
    deferred = DeferredBatchNorm(3)
    assert set(deferred.state_dict()) == set(nn.BatchNorm2d(3).state_dict())
    theirs = torchgpipe_batchnorm.DeferredBatchNorm(3)
    theirs.running_mean.fill_(0.5)
    assert "sum_squares" in theirs.state_dict()
    deferred.load_state_dict(theirs.state_dict())  # strict: their accumulators are ignored
    assert torch.equal(deferred.running_mean, torch.full((3,), 0.5))


def test_convert_replaces_every_tracking_batchnorm_sharing_parameters():
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model = nn.Sequential(inner, nn.BatchNorm2d(4, momentum=0.3).eval(),
                          nn.BatchNorm2d(4, track_running_stats=False), nn.Flatten(),
                          nn.BatchNorm1d(16, affine=False).double())
    weight, running_mean = inner[1].weight, inner[1].running_mean
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
    assert converted is model
    first = model[0][1]
    assert isinstance(first, DeferredBatchNorm) and first.chunks == 4
    assert first.weight is weight and first.running_mean is running_mean
    assert isinstance(model[1], DeferredBatchNorm) and model[1].momentum == 0.3
    assert not model[1].training
    assert not isinstance(model[2], DeferredBatchNorm)  # no running statistics to defer
    assert model[4].weight is None and model[4].tracked_mean.dtype == torch.float64
    # Converting again with the same chunks keeps the layers.
    assert DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)[0][1] is first
    # A bare batch norm is returned converted.
    assert isinstance(DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(2)),
                      DeferredBatchNorm)


def test_errors_quote_the_bad_value():
    with pytest.raises(ValueError, match=r"shape \(3,\).*unsqueeze"):
        DeferredBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match=r"chunks must be a positive integer.*got 0.*chunks=4"):
        DeferredBatchNorm(3, chunks=0)
