"""``pipetrain train --model hf-gpt2|hf-llama``: a Hugging Face model trains on the corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.train_runs import refused_here, run_here

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
         "--microbatches", "4", "--warmup", "2", "--lr", "1e-2", "--sample-bytes", "8"]


def _train(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pipetrain", "train", *SMALL, *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env)


def test_hf_model_trains_and_the_loss_falls(tmp_path: Path) -> None:
    """hf-llama (hf-gpt2 is built and profiled by tests/cli/test_profile.py, and GPT-2
    trains from the command line as a Hugging Face folder in test_user_workflow.py)."""
    out = tmp_path / "run"
    done = _train("--model", "hf-llama", "--steps", "10", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3  # from ~5.5 (uniform over bytes)
    assert (out / "checkpoint" / ".metadata").exists()
    assert (out / "sample.txt").exists()
    # Bug: `pipetrain sample` rebuilt pipetrain's GPT for every run and crashed on these
    # ("Missing key in checkpoint state_dict: model.layers.0.token.weight")
    sampled = run_here(["sample", str(out), "--bytes", "8"])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("def ") and len(sampled.stdout.rstrip("\n")) > 4
    assert "Traceback" not in sampled.stderr


def test_hf_model_refuses_a_layer_balance(tmp_path: Path) -> None:
    done = refused_here(["train", *SMALL, "--model", "hf-gpt2", "--steps", "1", "--balance",
                         "2,2", "--out", str(tmp_path / "run")])
    assert done.returncode == 2
    assert "--balance auto" in done.stderr
