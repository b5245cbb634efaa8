"""``pipetrain train`` run as a user runs it (a subprocess) and the losses it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_train(options: Sequence[str], *args: str, out: Path, timeout: float = 240,
              environment: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pipetrain train OPTIONS ARGS --out OUT`` with this interpreter's path
    (and ``environment`` added)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(environment or {}))
    return subprocess.run([sys.executable, "-m", "pipetrain", "train", *options, *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def run_trains(options: Sequence[str], runs: Sequence[tuple[Sequence[str], Path]], *,
               timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Several independent :func:`run_train` runs ``(args, out)`` at once (each run's
    start-up leaves the machine's cores partly idle); their results in the same order."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    commands = [[sys.executable, "-m", "pipetrain", "train", *options, *args, "--out", str(out)]
                for args, out in runs]
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for c in commands]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return [subprocess.CompletedProcess(c, p.returncode, o, e)
            for c, p, (o, e) in zip(commands, processes, outputs)]


def recorded_losses(out: Path) -> list[float]:
    """Each step's loss, from the run folder's metrics.json."""
    metrics = json.loads((out / "metrics.json").read_text())
    return [step["loss"] for step in metrics["steps"]]


def refused_here(argv: Sequence[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``pipetrain ARGV`` run through the command's ``main`` in this process (no start-up of
    a new interpreter), for commands that end before any worker starts: a launch fails the
    calling test. Its exit status and output, as :func:`run_train` returns them."""
    return run_here(argv, cwd=cwd, launch=False)


def run_here(argv: Sequence[str], *, cwd: Path | None = None,
             launch: bool = True) -> subprocess.CompletedProcess[str]:
    """``pipetrain ARGV`` (a command that starts no workers: ``sample``, ``plan``,
    ``profile``) through the command's ``main`` in this process, as :func:`run_train`
    returns it; ``launch=False``: a launch of workers fails the calling test."""
    import contextlib
    import io

    import pipetrain.launch
    from pipetrain.cli.main import main

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"pipetrain {' '.join(argv)} started workers: it was not refused")

    out, err = io.StringIO(), io.StringIO()
    before, launcher = Path.cwd(), pipetrain.launch.launch_local
    if not launch:
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
        pipetrain.launch.launch_local = launcher  # type: ignore[assignment]
        os.chdir(before)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def one_process_losses(options: Sequence[str]) -> list[float]:
    """The per-step losses of ``pipetrain train OPTIONS`` for pipetrain's GPT trained in
    this process as plain PyTorch (one model, the command's optimizer, LR schedule,
    clipping, batches and seed, from the same factories): what any pipeline of the same
    options must match."""
    import torch

    from pipetrain.cli.main import build_parser
    from pipetrain.cli.run_model import run_dataset
    from pipetrain.cli.train_checks import prepare
    from pipetrain.cli.train_optimizer import training_factories
    from pipetrain.cli.train_options import gpt_config
    from pipetrain.models import build_gpt, gpt_loss

    config, _, problems = prepare(build_parser().parse_args(["train", *options]))
    assert not problems and config.model == "gpt", problems
    dataset, _ = run_dataset(config)
    model = build_gpt(gpt_config(config), seed=config.seed)
    make_optimizer, make_scheduler, _ = training_factories(config, {})
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    losses = []
    for step in range(config.steps):
        inputs, targets = dataset.batch(step, config.step_batch_size)
        loss = gpt_loss(model(inputs), targets)
        losses.append(loss.item())
        loss.backward()
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses
