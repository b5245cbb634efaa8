"""``pipetrain train --dropout``: the losses do not depend on the number of stages.

The GPT's dropout modules and its attention's functional dropout
(``F.scaled_dot_product_attention(dropout_p=...)``) draw from streams keyed by layer and
micro-batch, so one stage and two stages train the same model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SMALL = ["--steps", "3", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
         "--batch-size", "8", "--microbatches", "4", "--sample-bytes", "0", "--eval-every", "0"]


def _losses(out: Path, *args: str) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "pipetrain", "train", *SMALL, *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, (args, done.stderr[-3000:])
    return [step["loss"] for step in json.loads((out / "metrics.json").read_text())["steps"]]


def test_dropout_gives_the_same_losses_with_one_and_two_stages(tmp_path: Path) -> None:
    one = _losses(tmp_path / "one", "--dropout", "0.1", "--stages", "1")
    two = _losses(tmp_path / "two", "--dropout", "0.1", "--stages", "2", "--checkpoint", "always")
    assert len(one) == 3
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= 1e-5, f"step {step}: {b} with --stages 2 vs {a} with --stages 1"
