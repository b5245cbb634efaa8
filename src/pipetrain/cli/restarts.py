"""``pipetrain train --max-restarts N``: a job that fails restarts its workers from its
newest intact checkpoint, up to N times, and the run goes on with one history.

The launcher decides, after a failed launch: a run that can be restarted has restarts
left, has a checkpoint to restart from (``--save-every``), and did not end on purpose or by
a mistake that would end it again (a usage error, exit status 2, or a non-finite step the
records name). It then launches the workers again with ``--resume`` of its own run folder:
they load the checkpoint and train the steps after it again, and the records keep the steps
up to the checkpoint (the later ones are trained and recorded anew). Each restart is
recorded in ``metrics.json`` under ``restarts``: what failed, when, after which step, the
step it restarted from, the steps and the seconds of training lost, and the seconds from
the failure to the restarted job's first step (``seconds_to_next_step``).
Under torchrun, torchrun restarts (its own ``--max-restarts N``; pipetrain's option is
refused there): a worker started again (``TORCHELASTIC_RESTART_COUNT`` above 0) resumes the
run folder given by ``--out`` from its newest intact checkpoint, and the restart is recorded
the same way, its cause unknown to the workers and its ``failed_at`` the time of the last
step recorded before the failure (:func:`torchrun_restart`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

__all__ = ["RESTARTS_ENV", "TORCHRUN_ATTEMPT_ENV", "restart_record", "restarted_argv",
           "restarts_seen", "torchrun_restart"]

RESTARTS_ENV = "PIPETRAIN_RESTARTS"
"""The restarts of this job so far (JSON), for the workers' records."""
TORCHRUN_ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""How many times torchrun has restarted this job's workers (torch.distributed.elastic's)."""


def _recorded(out: str) -> dict[str, Any]:
    from pipetrain.cli.run_folder import read_json

    try:
        return read_json(os.path.join(out, "metrics.json")) or {}
    except ValueError:
        return {}


def _steps(out: str) -> list[dict[str, Any]]:
    """The steps the run recorded (``steps.jsonl``: current after every step, even when the
    rank that writes ``metrics.json`` was the one killed)."""
    from pipetrain.cli.step_log import read_steps

    try:
        return list(read_steps(out))
    except (OSError, ValueError):
        return []


def restart_record(out: str, *, cause: str, exitcode: int, done: int, limit: int,
                   failed_at: float) -> tuple[dict[str, Any] | None, str]:
    """What restart ``done + 1`` of the run in ``out`` is (None: the run ends) and why.

    Example:
        >>> import tempfile
        >>> restart_record(tempfile.mkdtemp(), cause="x", exitcode=-9, done=0, limit=2,
        ...                failed_at=0.0)[1]
        'no checkpoint to restart from (without --save-every a run saves only at its end)'
    """
    from pipetrain.cli.worker_death import intact_checkpoint_step

    if done >= limit:
        return None, f"after {done} restart{'s' * (done != 1)} (--max-restarts {limit})"
    if exitcode == 2:
        return None, "a mistake in the options or inputs ends every attempt alike"
    metrics = _recorded(out)
    if (metrics.get("stopped") or {}).get("reason") == "nonfinite":
        return None, "a non-finite step stops the run on purpose"
    step = intact_checkpoint_step(out)
    if step is None:
        return None, ("no checkpoint to restart from (without --save-every a run saves only "
                      "at its end)")
    steps = [s for s in _steps(out) if isinstance(s.get("step"), int)]
    last = max((s["step"] for s in steps), default=step)
    lost = [s for s in steps if s["step"] > step]
    return {
        "number": done + 1,
        "cause": cause,
        "failed_at": datetime.datetime.fromtimestamp(failed_at).astimezone().isoformat(
            timespec="milliseconds"),
        "failed_at_unix": round(failed_at, 3),
        "after_step": last,
        "resumed_from_step": step,
        "steps_lost": max(0, last - step),
        "seconds_lost": round(sum(float(s.get("seconds") or 0.0) for s in lost), 3),
    }, ""


def restarted_argv(argv: list[str], out: str) -> list[str]:
    """``argv`` resuming the run folder ``out`` (any ``--resume`` of its own replaced).

    Example:
        >>> restarted_argv(["--stages", "2", "--resume", "old", "--out", "r"], "r")
        ['--stages', '2', '--out', 'r', '--resume', 'r']
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    return [*kept, "--resume", out]


def restarts_seen(earlier: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The run's restarts: those its records hold (``earlier``) and this job's (from the
    launcher, :data:`RESTARTS_ENV`), each once.

    Example:
        >>> restarts_seen([{"number": 1, "failed_at": "t1"}])
        [{'number': 1, 'failed_at': 't1'}]
    """
    found = list(earlier or [])
    try:
        current = json.loads(os.environ.get(RESTARTS_ENV, "[]"))
    except ValueError:
        current = []
    known = {entry.get("failed_at") for entry in found}
    return found + [entry for entry in current if entry.get("failed_at") not in known]


def torchrun_restart(args: argparse.Namespace, out: str | None) -> argparse.Namespace | None:
    """Under torchrun, in a worker that torchrun started again after a failure: ``args``
    resuming the run folder ``out`` (the restart recorded for the run's records through
    :data:`RESTARTS_ENV`); ``None`` in a first attempt or under pipetrain's own launcher.

    Raises:
        ValueError: the run cannot resume (no ``--out``, no intact checkpoint, a run that
            stopped on purpose), with the reason and the fix.

    Example:
        >>> torchrun_restart(argparse.Namespace(resume=None), "runs/x") is None  # attempt 0
        True
    """
    from pipetrain.launch.local import LAUNCHED_ENV

    try:
        attempt = int(os.environ.get(TORCHRUN_ATTEMPT_ENV, "0") or 0)
    except ValueError:
        attempt = 0
    if attempt == 0 or os.environ.get(LAUNCHED_ENV) == "1":
        return None
    if out is None:
        raise ValueError(f"torchrun restarted the workers (restart {attempt}), but the run has no "
                         "--out: a restarted job resumes its run folder; fix: give --out DIR")
    steps = os.path.join(out, "steps.jsonl")
    last_step_at = os.path.getmtime(steps) if os.path.exists(steps) else time.time()
    record, why = restart_record(
        out, cause=f"torchrun restarted the workers (restart {attempt}) after one failed",
        exitcode=1, done=attempt - 1, limit=attempt, failed_at=last_step_at)
    if record is None:
        raise ValueError(f"torchrun restarted the workers (restart {attempt}), but the run in "
                         f"{out!r} cannot resume: {why}")
    os.environ[RESTARTS_ENV] = json.dumps([record])
    given = set(getattr(args, "given", ())) | {"resume"}  # as if typed: --resume OUT
    return argparse.Namespace(**{**vars(args), "resume": out, "given": given})
