"""The comparison's life on each rank: build the runners, check the first steps, time.

Shared by the parts that put pipetrain beside torch.distributed.pipelining: every
schedule gets pipetrain's runner and each of torch's variants for it; a torch variant
that cannot be built or run is reported as not comparable (its error), never crashes
the run. The first two steps of every runner give its losses (same initial weights,
same batches: the same work); then the harness times the runners round-robin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipetrain.bench.harness import agree, gather_objects, interleave
from pipetrain.bench.vs_torch.runners import TORCH_VARIANTS

__all__ = ["build_runners", "first_losses", "time_runners"]


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def build_runners(schedules: Sequence[str], pipetrain: Callable[[str], Any],
                  torch: Callable[[str, tuple[str, str, int, str]], Any]
                  ) -> tuple[list[Any], dict[str, str]]:
    """pipetrain's runner and torch's variants for every schedule (every rank calls it);
    the runners and, by label, why a torch variant is not comparable."""
    runners: list[Any] = []
    failures: dict[str, str] = {}
    for schedule in schedules:
        runners.append(pipetrain(schedule))
        for variant in TORCH_VARIANTS[schedule]:
            error, runner = "", None
            try:
                runner = torch(schedule, variant)
            except Exception as exc:  # an API limit: report, do not crash
                error = _first_line(exc)
            errors = agree(not error, error)
            if errors:
                failures[variant[0]] = errors[0]
            else:
                runners.append(runner)
    return runners, failures


def first_losses(runners: list[Any], batch: Callable[[int], Sequence[Any]],
                 failures: dict[str, str], steps: int = 2) -> dict[str, list[float]]:
    """The losses of each runner's first ``steps`` steps (also its first warm-up); a
    runner whose first step fails is dropped and reported in ``failures``."""
    losses: dict[str, list[float]] = {}
    for runner in list(runners):
        values: list[float] = []
        error = ""
        try:
            for k in range(steps):
                values.append(runner.loss(runner.step(*batch(k))))
        except Exception as exc:
            error = _first_line(exc)
        errors = agree(not error, error)
        if errors:
            failures[runner.label] = "first step failed: " + errors[0]
            runners.remove(runner)
            continue
        key = runner.label if runner.framework == "torch" else f"pipetrain:{runner.label}"
        losses[key] = values
    return losses


def time_runners(runners: Sequence[Any], batch: Callable[[int], Sequence[Any]], *, reps: int,
                 warmup: int, microbatches: int) -> tuple[list[Any], dict[str, Any]]:
    """Warm up and time the runners round-robin; every rank's samples, records and
    cpu window (gathered on every rank), and on rank 0 what each runner ran."""
    import torch.distributed as dist

    samples, window = interleave(list(runners), batch, reps=reps, warmup=warmup)
    mine = {
        "samples": samples,
        "cpu_window": window,
        "records": {r.label: r.records for r in runners if getattr(r, "records", None)},
        "scale_seconds": {r.label: r.scale_seconds for r in runners
                          if getattr(r, "framework", None) == "torch"},
    }
    gathered = gather_objects(mine)
    info: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for runner in runners:
            if not hasattr(runner, "schedule_name"):
                continue  # an anchor without a pipeline schedule
            entry = {"framework": runner.framework, "schedule": runner.schedule_name,
                     "num_stages": runner.num_stages, "stage_to_rank": runner.stage_to_rank}
            if runner.framework == "pipetrain":
                entry["pipeline_schedule"] = runner.pipe.schedule(microbatches)
            elif runner.framework == "torch":
                entry["compute_order"] = runner.compute_order()
            info[runner.label] = entry
    for runner in runners:
        if hasattr(runner, "close"):
            runner.close()
    dist.barrier()
    return gathered, info
