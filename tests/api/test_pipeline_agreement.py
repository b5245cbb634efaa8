"""Ranks that disagree are refused on every rank, naming what differs (gloo, 2 ranks).

One job checks every case: different balances, micro-batch counts, schedules, several
fields at once, a captured model built differently, a command line's options, and the
first training step's batch; settings that may differ (waits) and equal spellings of the
same value (a schedule's alias, a tuple for a list) are not refused, and a pipeline
that refused a batch trains on.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers.agreement_jobs import disagreement_job
from helpers.distributed import run_workers

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def found() -> list[dict[str, Any]]:
    return run_workers(disagreement_job, 2, timeout=180)


def _same_on_both(found: list[dict[str, Any]], case: str) -> tuple[str, dict[str, dict[int, str]]]:
    first, second = found[0][case], found[1][case]
    assert first is not None, f"{case} was not refused"
    assert first == second, f"{case}: the ranks were refused differently"
    return first  # type: ignore[no-any-return]


def test_different_balances_are_refused_on_both_ranks(found: list[dict[str, Any]]) -> None:
    """Bug: balance=[1, 3] on rank 0 and [2, 2] on rank 1 trained with a layer on no rank."""
    message, differences = _same_on_both(found, "balance")
    assert message == (
        "ranks disagree on PipelineConfig.balance: rank 0 has [1, 3], rank 1 has [2, 2]; fix: "
        "build the Pipeline from the same PipelineConfig, model and arguments on every rank "
        "(only timeout, heartbeat_timeout, exit_when_stuck may differ)")
    assert differences == {"PipelineConfig.balance": {0: "[1, 3]", 1: "[2, 2]"}}


def test_different_micro_batch_counts_and_schedules_are_refused(found: list[dict[str, Any]]) -> None:
    message, _ = _same_on_both(found, "num_microbatches")
    assert message.startswith(
        "ranks disagree on PipelineConfig.num_microbatches: rank 0 has 4, rank 1 has 8; fix:")
    message, _ = _same_on_both(found, "schedule")
    assert message.startswith(
        "ranks disagree on PipelineConfig.schedule: rank 0 has '1f1b', rank 1 has 'gpipe'; fix:")


def test_every_difference_is_reported_at_once(found: list[dict[str, Any]]) -> None:
    message, differences = _same_on_both(found, "several")
    assert sorted(differences) == ["PipelineConfig.balance", "PipelineConfig.seed"]
    assert message.splitlines() == [
        "ranks disagree on 2 values of the Pipeline's set-up:",
        "  * PipelineConfig.balance: rank 0 has [1, 3], rank 1 has [2, 2]",
        "  * PipelineConfig.seed: rank 0 has 0, rank 1 has 1",
        "fix: build the Pipeline from the same PipelineConfig, model and arguments on every "
        "rank (only timeout, heartbeat_timeout, exit_when_stuck may differ)",
    ]


def test_waits_and_spellings_of_the_same_value_may_differ(found: list[dict[str, Any]]) -> None:
    assert found[0]["alias_and_waits"] is None and found[1]["alias_and_waits"] is None


def test_a_captured_model_built_differently_is_refused(found: list[dict[str, Any]]) -> None:
    message, differences = _same_on_both(found, "captured")
    assert list(differences) == ["the model's parameters and buffers"]
    assert message.startswith(
        "ranks disagree on the model's parameters and buffers: rank 0 has {'up.weight': "
        "(16, 8) float32, 'up.bias': (16,) float32, 'down.weight': (8, 16) float32}, rank 1 "
        "has {'up.weight': (32, 8) float32, 'up.bias': (32,) float32, 'down.weight': "
        "(8, 32) float32}; fix:")


def test_a_command_line_can_compare_its_own_options(found: list[dict[str, Any]]) -> None:
    message, differences = _same_on_both(found, "cli")
    assert sorted(differences) == ["--balance", "--batch-size"]
    assert "  * --balance: rank 0 has '1,3', rank 1 has '2,2'" in message.splitlines()
    assert "  * --batch-size: rank 0 has 8, rank 1 has 16" in message.splitlines()
    assert message.endswith("fix: launch every host with the same options")


def test_different_first_batches_are_refused_and_training_goes_on(found: list[dict[str, Any]]) -> None:
    """Bug: batches of 8 and 4 samples failed deep in the step with 'The size of tensor a
    (4) must match the size of tensor b (2)', naming no cause."""
    message, differences = _same_on_both(found, "batch")
    assert message.splitlines()[0] == "ranks disagree on 3 values of the first train_step's batch:"
    assert "  * train_step's batch size: rank 0 has 8, rank 1 has 4" in message.splitlines()
    assert differences["train_step's inputs"] == {0: "(8, 8) float32", 1: "(4, 8) float32"}
    assert message.endswith("fix: every rank passes the same global batch to train_step")
    for rank in found:
        assert rank["step_after_refusal"] == 0 and rank["steps"] == 2
    assert found[0]["losses"] == found[1]["losses"]
    assert all(loss > 0 for loss in found[0]["losses"])


def test_a_rank_gone_before_the_comparison_is_an_error_not_a_wait(found: list[dict[str, Any]]) -> None:
    message = found[0]["peer_gone"]
    assert message is not None and message.startswith(
        "RuntimeError: rank 0 could not compare the Pipeline's set-up with the other ranks:")
    assert "another rank probably failed before the comparison" in message
