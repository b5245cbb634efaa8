"""What a ``pipetrain train`` run reports: each step's timeline gathered on rank 0, the
peak memory of a rank, the summary at the end, and the line of an interrupted run."""

from __future__ import annotations

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
    session = records.session_steps
    if not session:
        return
    first, last = session[0], session[-1]
    trained = (f"trained {len(session)} steps ({first['step']}-{last['step']})"
               if first["step"] > 1 else f"trained {len(session)} steps")
    validated = f" (validation {last['val_loss']:.3f})" if "val_loss" in last else ""
    files = ["metrics.json", "timeline.png", "loss.png", "trace.json", "checkpoint/"]
    files += ["sample.txt"] if sample is not None else []
    lines = [f"{trained}: loss {first['loss']:.3f} -> {last['loss']:.3f}{validated}",
             f"run folder: {out}  ({', '.join(files)})"]
    if sample is not None:
        lines += ["sample:", sample]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
