"""The launcher's last line when a worker dies without a word (``kill -9``, the kernel's
out-of-memory killer, a crash): which rank and stage died, after which step, what the
run folder keeps, and the command that continues the run.

Example:
    >>> import tempfile
    >>> from pipetrain.cli.main import build_parser
    >>> args = build_parser().parse_args(["train", "--stages", "2", "--replicas", "2",
    ...                                   "--save-every", "10", "--out", tempfile.mkdtemp()])
    >>> print(death_line(args, rank=3, exitcode=-9, started=0.0))
    worker rank 3 (stage 1, replica 1) was killed by SIGKILL; no checkpoint was saved yet (the first was due at step 10): start the run again with a new --out
"""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["death_line", "intact_checkpoint_step"]


def _replica_counts(args: Any) -> tuple[int, ...]:
    """Replicas of each pipeline rank: a plan's, or ``--replicas`` on every stage."""
    counts = getattr(args, "stage_replicas", None)
    if counts:
        return tuple(int(n) for n in counts)
    if getattr(args, "plan", None):
        from pipetrain.plan import Plan

        return tuple(stage.replicas for stage in Plan.load(args.plan).stages)
    return (int(args.replicas),) * int(args.stages)


def _where(args: Any, rank: int) -> str:
    """`` (stage 1)``, `` (stage 1, replica 2)``, `` (stages 0 and 3)``; '' if unknown."""
    try:
        from pipetrain.api.config import PipelineConfig
        from pipetrain.cli.train_options import stages_per_rank
        from pipetrain.schedule.replicated import replica_ranks

        groups = replica_ranks(_replica_counts(args))
        pipeline_rank = next(p for p, group in enumerate(groups) if rank in group)
        config = PipelineConfig(schedule=args.schedule, num_stages=len(groups),
                                stages_per_rank=stages_per_rank(args),
                                num_microbatches=args.microbatches)
        stages = [j for j, p in enumerate(config.stage_to_rank) if p == pipeline_rank]
    except Exception:  # a description only: never fail the last line
        return ""
    if not stages:
        return ""
    held = (f"stage {stages[0]}" if len(stages) == 1 else
            f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}")
    if len(groups[pipeline_rank]) > 1:
        held += f", replica {groups[pipeline_rank].index(rank)}"
    return f" ({held})"


def _last_step(out: str, started: float) -> tuple[int, bool] | None:
    """The last step the run's records show, if this session wrote them, and whether it
    is where the run stopped (a surviving rank 0 records that) or only the last record
    (rank 0, which writes them, died)."""
    from pipetrain.cli.run_folder import read_json
    from pipetrain.cli.step_log import last_recorded

    path = os.path.join(out, "metrics.json")
    try:
        metrics: dict[str, Any] = (read_json(path) or {}) if os.path.getmtime(path) >= started else {}
    except (OSError, ValueError):
        metrics = {}
    stopped = metrics.get("stopped") or {}
    if isinstance(stopped.get("at_step"), int):
        return int(stopped["at_step"]), True
    found = last_recorded(out)  # steps.jsonl, appended at every step
    try:
        return (found[0], False) if found and os.path.getmtime(found[1]) >= started else None
    except OSError:
        return None


def intact_checkpoint_step(out: str) -> int | None:
    """The step of the checkpoint a ``--resume`` of ``out`` would continue from (None:
    there is none intact).

    Example:
        >>> intact_checkpoint_step("/nonexistent/run") is None
        True
    """
    from pipetrain.api.checkpoint_files import find_intact

    try:
        found, _ = find_intact(os.path.join(out, "checkpoint"), checksums=False)
    except Exception:  # a description only: never fail the last line
        return None
    return None if found is None else found.step


def death_line(args: Any, *, rank: int, exitcode: int, started: float) -> str:
    """The last line for worker ``rank`` that ended with ``exitcode`` (negative: killed by
    that signal) without a message of its own; ``started``: when the job was launched
    (``time.time()``), so that records of an earlier session are not read as this one's.
    """
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode} without a message"
    step = _last_step(args.out, started)
    after = "" if step is None else f" after step {step[0]}" if step[1] else (
        f" after step {step[0]} or later (the last one recorded)")
    checkpoint = intact_checkpoint_step(args.out)
    head = f"worker rank {rank}{_where(args, rank)} {how}{after}"
    if checkpoint is None and args.save_every:
        return (f"{head}; no checkpoint was saved yet (the first was due at step "
                f"{args.save_every}): start the run again with a new --out")
    if checkpoint is None:
        return (f"{head}; no checkpoint was saved (without --save-every a run saves only at "
                f"its end): start the run again with a new --out, and --save-every N to "
                f"save every N steps")
    return (f"{head}; the checkpoint in {args.out} is at step {checkpoint}; continue with: "
            f"pipetrain train --resume {args.out}")
