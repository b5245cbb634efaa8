"""What a ``pipetrain train`` run reports: each step's timeline gathered on rank 0, the
peak memory of a rank, the summary at the end, and the line of an interrupted run."""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.api.pipeline import Pipeline
from pipetrain.cli.train_records import RunRecords
from pipetrain.schedule import TimedAction
from pipetrain.trace import offsets_from_origins

__all__ = ["gather_step", "interrupted_line", "one_axis", "peak_memory_bytes", "report"]


def interrupted_line(metrics: dict[str, Any], out: str) -> str:
    """The one line that tells what an interrupted run kept."""
    stopped = metrics.get("stopped") or {}
    checkpoint = stopped.get("checkpoint_step")
    if stopped.get("saved_now"):
        kept = f"saved the checkpoint (step {checkpoint}) and the records in {out}"
    elif checkpoint is not None:
        kept = f"no new step to save; the checkpoint in {out} is at step {checkpoint}"
    else:
        kept = f"no checkpoint was saved (no step finished); the records are in {out}"
    return (f"interrupted by {stopped.get('signal', 'a signal')} after step {stopped.get('at_step')}: "
            f"{kept}; continue with: pipetrain train --resume {out}")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gather_step(pipe: Pipeline) -> list[tuple[float, list[TimedAction]]] | None:
    """Every rank's (wall-clock origin, actions) of the last step, on rank 0."""
    mine = (pipe.last_step_start, pipe.last_timeline)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    return gathered if dist.get_rank() == 0 else None


def one_axis(gathered: list[tuple[float, list[TimedAction]]]) -> list[TimedAction]:
    offsets = offsets_from_origins([origin for origin, _ in gathered])
    return [
        TimedAction(rank, t.action, t.start + offsets[rank], t.end + offsets[rank])
        for rank, (_, actions) in enumerate(gathered)
        for t in actions
    ]


def report(out: str, records: RunRecords, sample: str | None) -> None:
    """The lines a finished run prints: the steps it trained, the loss, the files of its
    run folder (those written) and the sample."""
    first, last = records.session_first, records.last
    if first is None or last is None:
        return
    count = records.session_count
    steps = f"{count} step{'s' * (count != 1)}"
    trained = (f"trained {steps} ({first['step']}-{last['step']})"
               if first["step"] > 1 else f"trained {steps}")
    validated = (f" (validation {last['val_loss']:.3f})"
                 if isinstance(last.get("val_loss"), float) else "")
    files = ["metrics.json", "steps.jsonl", "timeline.png", "loss.png", "trace.json",
             "checkpoint/", "sample.txt"]
    files = [name for name in files if os.path.exists(os.path.join(out, name))]
    lines = [f"{trained}: loss {_loss(first)} -> {_loss(last)}{validated}",
             f"run folder: {out}  ({', '.join(files)})"]
    if sample is not None:
        lines += ["sample:", sample]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _loss(record: dict[str, Any]) -> str:
    loss = record.get("loss")
    return f"{loss:.3f}" if isinstance(loss, float) else "null"
