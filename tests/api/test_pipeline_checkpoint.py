"""Save / load with torch.distributed.checkpoint: exact resume, and resharding to fewer stages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import gpt_resume_job

pytestmark = pytest.mark.distributed


def _merge(results: list[tuple[dict, list[float], object]]) -> dict:
    merged: dict = {}
    for params, _, _ in results:
        merged.update(params)
    return merged


def test_resume_continues_exactly_and_reshards_from_four_to_two_stages(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    uninterrupted = run_workers(gpt_resume_job, 4, 4, path, 0, 10, 5, False, timeout=300)
    assert os.path.exists(os.path.join(path, ".metadata"))
    assert not os.path.exists(path + ".partial")

    same_layout = run_workers(gpt_resume_job, 4, 4, path, 5, 10, None, True, timeout=300)
    fewer_stages = run_workers(gpt_resume_job, 2, 2, path, 5, 10, None, True, timeout=300)

    expected = _merge(uninterrupted)
    for resumed in (same_layout, fewer_stages):
        extra, step = resumed[0][2]
        assert extra == {"data_step": 5}
        assert step == 10
        params = _merge(resumed)
        assert set(params) == set(expected)
        for name, value in expected.items():
            assert (params[name] - value).abs().max() == 0, name
        # the losses of steps 6..10 are the uninterrupted run's
        assert resumed[0][1] == uninterrupted[0][1][5:]


def test_loading_a_folder_without_a_checkpoint_names_it(tmp_path: Path) -> None:
    outcome = run_workers(gpt_resume_job, 2, 2, str(tmp_path / "missing"), 0, 1, None, True,
                          timeout=120, expect_errors=True)
    for status, text in outcome:
        assert status == "error"
        assert "FileNotFoundError" in text and "missing" in text and "no pipetrain checkpoint" in text
