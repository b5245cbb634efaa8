"""A dead peer gives every other rank an error naming it, quickly; bad input is named."""

from __future__ import annotations

import time

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import construction_error_job, killed_peer_job, mismatched_job
from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import Layout
from pipetrain.launch.processes import run_processes

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_peer_makes_every_other_rank_fail_naming_it(victim: int) -> None:
    """Rank ``victim`` is SIGKILLed in step 3 of a 3-stage pipeline; rank 0 also hosts
    the job's store, so killing it takes the store down too."""
    started = time.monotonic()
    # fresh interpreters: a rank that reports its failure then exits as slowly as a worker
    # does (a forked rank exits at once, and a neighbour may then blame it instead)
    outcome = run_processes(killed_peer_job, 3, victim, 3, timeout=90, expect_errors=True)
    elapsed = time.monotonic() - started
    assert elapsed < 60 + 15  # 60 s for the failure, plus process start-up
    for rank, (status, value) in enumerate(outcome):
        if rank == victim:
            assert status == "missing"  # killed: it reported nothing
            continue
        assert status == "ok", value
        message, seconds = value
        assert f"rank {victim}" in message and ("died" in message or "unreachable" in message), message
        assert seconds < 60, f"rank {rank} took {seconds:.0f} s to notice"


def test_a_stage_output_the_next_stage_cannot_take_is_named() -> None:
    outcome = run_workers(mismatched_job, 2, timeout=120, expect_errors=True)
    (status0, text0), (status1, text1) = outcome
    # the failing stage reports the shapes it received
    assert status1 == "ok" and "RuntimeError" in text1
    assert "stage 1 on the output of stage 0" in text1 and "(2, 32) float32" in text1
    # its neighbour names the failing rank and its error
    assert status0 == "ok" and "PeerFailure" in text0
    assert "rank 1 failed with RuntimeError" in text0


def test_construction_errors_name_the_bad_value() -> None:
    outcome = run_workers(construction_error_job, 2,
                          {"num_stages": 2, "stages_per_rank": 2, "schedule": "interleaved-1f1b",
                           "num_microbatches": 1}, 8, timeout=120)
    for text in outcome:
        assert "ValueError" in text and "interleaved-1f1b" in text and "1 micro-batches" in text
    outcome = run_workers(construction_error_job, 2, {"num_stages": 2}, 1, timeout=120)
    for text in outcome:
        assert "more stages than layers: 2 stages" in text and "1 layers" in text


def test_layout_and_config_errors_need_no_processes() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'.*gpipe, 1f1b"):
        PipelineConfig(schedule="zigzag")
    with pytest.raises(ValueError, match="num_microbatches=0 must be a positive integer"):
        PipelineConfig(num_microbatches=0)
    with pytest.raises(ValueError, match="stages_per_rank=2 needs an interleaved schedule"):
        PipelineConfig(schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="more stages than layers: 8 stages"):
        Layout.create(PipelineConfig(num_stages=4, stages_per_rank=2, schedule="interleaved-1f1b"),
                      num_layers=6)
    with pytest.raises(ValueError, match=r"balance \[2, 2\] has 2 entries but the pipeline has 4 stages"):
        Layout.create(PipelineConfig(num_stages=4, balance=[2, 2]), num_layers=4)
    layout = Layout.create(PipelineConfig(num_stages=2, replicas=2, balance=[3, 1]), num_layers=4)
    assert layout.layer_ranges == (range(0, 3), range(3, 4))
    assert layout.placement().rank(1, 1) == 3 and layout.placement().rank(1, 2) == 2
