"""Asynchronous schedules across saves, evaluations and batch sizes (gloo, float64 MLP).

A save drains the pipeline; a pipeline that loads it continues exactly as the run that
saved (weights, losses, 2BW's previous version, the micro-batch numbering). An
evaluation needs no drain and changes nothing. A batch with fewer micro-batches drains
first; 2BW's rule holds across the drain.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.async_jobs import odd_input_job, resume_job, two_bw_reference
from helpers.distributed import run_workers

pytestmark = pytest.mark.distributed

CONFIGS = [
    {"schedule": "pipedream", "num_stages": 2, "num_microbatches": 4},
    {"schedule": "pipedream", "num_stages": 2, "num_microbatches": 4, "vertical_sync": True},
    {"schedule": "2bw", "num_stages": 2, "num_microbatches": 3, "checkpoint": "always"},
]


def _same(a: tuple[dict[str, torch.Tensor], list[float]], b: tuple[dict[str, torch.Tensor], list[float]]) -> bool:
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def test_resume_continues_exactly_and_evaluation_changes_nothing(tmp_path: Any) -> None:
    outcome = run_workers(resume_job, 2, CONFIGS, str(tmp_path), timeout=600)
    for c, config in enumerate(CONFIGS):
        for rank in outcome:
            result = rank[c]
            evaluated, plain, resumed = result["evaluated"], result["plain"], result["resumed"]
            assert _same(evaluated, plain), f"{config}: an evaluation changed the training"
            # the save drained the first run too: the run that saved and the resumed one agree
            assert _same((evaluated[0], evaluated[1][3:]), resumed), config
            assert result["step"] == 6
            assert len(evaluated[1]) == 6


def test_smaller_batch_drains_and_keeps_the_2bw_rule() -> None:
    sizes = [8, 8, 2, 8, 8]
    result = run_workers(odd_input_job, 2, sizes, timeout=300)
    reference = two_bw_reference(2, steps=len(sizes), batch=sizes, microbatches=4)
    params: dict[str, torch.Tensor] = {}
    for rank in result:
        params.update(rank["params"])
    assert max(float((params[k] - reference["params"][k]).abs().max()) for k in params) < 1e-6
    assert result[0]["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    for rank in result:
        assert "schedule 'pipedream' cannot train tied weights" in rank["ties"]
        assert "fix: untie them (e.g. GPTConfig(tie_embeddings=False))" in rank["ties"]
