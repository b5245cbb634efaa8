"""A step's guards: non-finite steps change nothing, too-small first batches are refused,
evaluation takes any batch, and saves survive what an interrupted save left behind."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.guard_jobs import (
    batch_size_job,
    leftover_save_job,
    nonfinite_job,
    nontensor_output_job,
    paramless_stage_job,
    seeded_linear,
    small_eval_job,
)

pytestmark = pytest.mark.distributed


def test_a_non_finite_step_applies_no_update_on_any_stage() -> None:
    """Bug: a NaN loss trained on to the end and replaced the good weights."""
    for found in run_workers(nonfinite_job, 2, timeout=180):
        message, step = found["error"]
        assert step == 2 and "step 2 is not finite: loss nan" in message
        assert "weights are those after step 1" in message and "fix:" in message
        assert found["error_kept_weights"] and found["error_step"] == 1 and found["error_lr_kept"]
        assert found["after_error_moved"]
        loss_is_nan, skipped, step, unchanged = found["skip"]
        assert loss_is_nan and skipped and step == 2 and unchanged
        skipped_again, unchanged_again, norm = found["skip_then"]
        assert not skipped_again and not unchanged_again and math.isfinite(norm)


def test_a_first_batch_smaller_than_the_micro_batches_is_refused() -> None:
    """Bug: --batch-size 2 --microbatches 8 silently ran 2 micro-batches."""
    for found in run_workers(batch_size_job, 2, timeout=180):
        message = found["small_first"]
        assert message is not None and "a batch of 2 samples" in message
        assert "num_microbatches=8" in message and "fix:" in message and "num_microbatches=2" in message
        assert found["step_after_refusal"] == 0
        assert found["steps"] == 2  # a smaller later batch still trains


def test_evaluation_batches_smaller_than_the_replicas() -> None:
    """Bug: `pipetrain train --replicas 2` crashed while sampling (a batch of one sample
    cannot feed two replicas) and lost the run's records."""
    for found in run_workers(small_eval_job, 2, timeout=180):
        torch.testing.assert_close(found["output"], found["expected"], rtol=1e-5, atol=1e-6)
        assert found["loss"] == pytest.approx(found["expected_loss"], rel=1e-5)


def test_saves_survive_the_leftovers_of_interrupted_saves(tmp_path: Path) -> None:
    """Bug: a half-deleted checkpoint.previous/ made every later save fail with
    'Directory not empty', losing the resumed run."""
    (found,) = run_workers(leftover_save_job, 1, str(tmp_path), timeout=180)
    assert found["after_half_deleted_previous"] == ["checkpoint", "checkpoint.step-1"]
    assert found["found_between_renames"] == "checkpoint.partial"  # step 3, newer than step 2
    assert found["loaded_between_renames"] == {"at": 3}
    assert found["after_between_renames"] == ["checkpoint", "checkpoint.step-3"]
    assert found["found_previous"] == "checkpoint.previous"  # step 4, newer than step 3
    assert found["after_previous"] == ["checkpoint", "checkpoint.step-4"]
    assert found["found_partial"] == "checkpoint.partial"
    assert found["after_partial"] == ["checkpoint", "checkpoint.step-5"]
    assert found["final_extra"] == {"at": 6}


def test_a_stage_without_parameters_needs_no_optimizer() -> None:
    """Bug: a stage holding only parameter-free layers failed with 'optimizer got an empty
    parameter list'."""
    model = torch.nn.Sequential(torch.nn.Tanh(), seeded_linear())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    expected = []
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(model(x), x)
        expected.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    first, second = run_workers(paramless_stage_job, 2, timeout=120)
    assert first["lr"] is None and second["lr"] == 0.1
    for found in (first, second):
        assert found["losses"] == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(second["weights"]["layers.1.weight"], model[1].weight.detach())


def test_a_last_stage_output_the_loss_cannot_take_is_blamed_on_the_last_stage() -> None:
    """Bug: a last-stage layer returning a non-tensor blamed stage 0's output in the hint."""
    _, (status1, text1) = run_workers(nontensor_output_job, 2, timeout=120, expect_errors=True)
    assert status1 == "ok", text1
    assert "loss_fn on the output of the last stage (1): {'h': (2, 8) float32}" in text1
    assert "last layer must return what loss_fn(output, target) takes" in text1
    assert "check that stage 0's output" not in text1
