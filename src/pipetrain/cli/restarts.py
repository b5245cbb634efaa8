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
Only ``pipetrain train``'s own launcher restarts; under torchrun the option is refused.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

__all__ = ["RESTARTS_ENV", "restart_record", "restarted_argv", "restarts_seen"]

RESTARTS_ENV = "PIPETRAIN_RESTARTS"
"""The restarts of this job so far (JSON), for the workers' records."""


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
