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


def refused_here(argv: Sequence[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``pipetrain ARGV`` run through the command's ``main`` in this process (no start-up of
    a new interpreter), for commands that end before any worker starts: a launch fails the
    calling test. Its exit status and output, as :func:`run_train` returns them."""
    import contextlib
    import io

    import pipetrain.launch
    from pipetrain.cli.main import main

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"pipetrain {' '.join(argv)} started workers: it was not refused")

    out, err = io.StringIO(), io.StringIO()
    before, launch = Path.cwd(), pipetrain.launch.launch_local
    pipetrain.launch.launch_local = no_launch  # type: ignore[assignment]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exit_:  # argparse's refusals
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        pipetrain.launch.launch_local = launch  # type: ignore[assignment]
        os.chdir(before)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())
