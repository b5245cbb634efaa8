"""The interleaved timing loop: repetitions round-robin over the runners, each step timed.

A *runner* is anything with a ``label`` and a ``step(*batch)``; optionally ``ranks``
(the ranks that take part; default all: a single-process anchor runs on rank 0 alone)
and ``after_timed_step()`` (called after each timed step, outside the timing: e.g. to
keep the step's recorded actions). Every step starts after a barrier; each rank times
it with ``perf_counter`` and notes the CPU time of its main thread and of its other
threads (receive threads, gloo's, monitors: on a 2-core machine busy with 2 ranks,
background CPU is taken from compute). A step's time is the max over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.bench.harness.machine import CpuWindow

__all__ = ["Sample", "interleave", "step_times"]


@dataclass(frozen=True)
class Sample:
    """One rank's view of one timed step."""

    wall_s: float | None
    """Wall time of the step on this rank (``None``: the rank did not take part)."""
    main_cpu_s: float
    """CPU time of the main thread (for a rank not taking part: between the barriers)."""
    other_cpu_s: float
    """CPU time of the process's other threads."""


def _takes_part(runner: Any, rank: int) -> bool:
    ranks = getattr(runner, "ranks", None)
    return ranks is None or rank in ranks


def interleave(runners: Sequence[Any], batch: Callable[[int], Sequence[Any]], *, reps: int,
               warmup: int, rotate: bool = False) -> tuple[dict[str, list[Sample]], dict[str, Any]]:
    """Warm up, then time ``reps`` repetitions going round-robin over ``runners``
    (every rank calls it with the same runners). Repetition ``k`` gives every runner
    ``batch(k)`` (warm-up steps: ``batch(k)`` for ``k < warmup``); ``rotate`` starts each
    repetition with the next runner. Returns this rank's samples by label and the
    :class:`~pipetrain.bench.harness.machine.CpuWindow` of the timed loop.

    Example (on every rank)::

        samples, window = interleave(runners, lambda k: pool[k % 4], reps=25, warmup=5)
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    for k in range(warmup):
        for runner in runners:
            dist.barrier()
            if _takes_part(runner, rank):
                runner.step(*batch(k))
            if getattr(runner, "ranks", None) is not None:
                dist.barrier()
    samples: dict[str, list[Sample]] = {r.label: [] for r in runners}
    dist.barrier()
    window = CpuWindow()
    for k in range(reps):
        shift = k % len(runners) if rotate else 0
        for runner in [*runners[shift:], *runners[:shift]]:
            args = batch(k)
            partial = getattr(runner, "ranks", None) is not None
            dist.barrier()
            c0, m0 = time.process_time(), time.thread_time()
            if _takes_part(runner, rank):
                t0 = time.perf_counter()
                runner.step(*args)
                wall: float | None = time.perf_counter() - t0
            else:
                dist.barrier()
                wall = None
            m1, c1 = time.thread_time(), time.process_time()
            if partial and wall is not None:
                dist.barrier()
            samples[runner.label].append(Sample(wall, m1 - m0, (c1 - c0) - (m1 - m0)))
            if wall is not None and hasattr(runner, "after_timed_step"):
                runner.after_timed_step()
    dist.barrier()
    return samples, window.close()


def step_times(per_rank: Sequence[dict[str, list[Sample]]], label: str) -> list[float]:
    """The step times of runner ``label``: per repetition, the max over the ranks that
    took part (``per_rank``: every rank's samples, as :func:`interleave` returned them).

    Example:
        >>> a = {"x": [Sample(1.0, 0.0, 0.0)]}
        >>> b = {"x": [Sample(2.0, 0.0, 0.0)]}
        >>> step_times([a, b], "x")
        [2.0]
    """
    reps = len(per_rank[0][label])
    return [max(wall for s in per_rank if (wall := s[label][k].wall_s) is not None)
            for k in range(reps)]
