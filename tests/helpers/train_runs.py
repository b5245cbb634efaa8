"""``pipetrain train`` run as a user runs it (a subprocess) and the losses it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_train(options: Sequence[str], *args: str, out: Path,
              timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m pipetrain train OPTIONS ARGS --out OUT`` with this interpreter's path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "pipetrain", "train", *options, *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def recorded_losses(out: Path) -> list[float]:
    """Each step's loss, from the run folder's metrics.json."""
    metrics = json.loads((out / "metrics.json").read_text())
    return [step["loss"] for step in metrics["steps"]]
