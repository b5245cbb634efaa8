"""A captured model's checkpoint, under the model's own names, reshards to other stage counts.

GPT-2 trained 2 steps as a 2-stage pipeline and saved, then loaded by a 1-stage
pipeline (a fresh model with other weights) that trains step 3, ends where 3 steps of
single-process training end.
"""

from __future__ import annotations

import os

import pytest

from helpers.distributed import run_workers
from helpers.frontend_jobs import lm_reference, resume_job

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed


def test_checkpoint_of_a_captured_model_reshards(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "checkpoint")
    first = run_workers(resume_job, 2, "gpt2", path, range(0, 2), True, timeout=600)
    assert os.path.isfile(os.path.join(path, ".metadata"))
    second = run_workers(resume_job, 1, "gpt2", path, range(2, 3), False, timeout=600)
    ref_state, ref_losses, _ = lm_reference("gpt2", 3)
    assert second[0]["step"] == 3
    state = second[0]["state"]
    assert set(state) == set(ref_state)
    assert max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state) < 1e-5
    losses = [*first[0]["losses"], *second[0]["losses"]]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
