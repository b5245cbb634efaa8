"""The simulator: a schedule's makespan, bubble and peak activations under given costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipetrain.schedule.actions import Op
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.execution import TimedAction, execute
from pipetrain.schedule.program import Schedule
from pipetrain.schedule.validate import ScheduleError, deadlock_problems

__all__ = ["DEFAULT_COSTS", "SimulationResult", "simulate"]

DEFAULT_COSTS = Costs()
"""Forward 1, backward 2 (input and weight halves 1 each), no communication latency."""


@dataclass(frozen=True)
class SimulationResult:
    """How a schedule plays out: per-rank lists are indexed by rank.

    ``busy`` counts compute actions and optimizer steps (not waits, not the background
    all-reduce); ``idle = makespan - busy``; ``bubble_fraction`` is the idle share of
    all ranks' time. ``peak_activations`` is, per rank, the most (stage, micro-batch)
    pairs whose forward ran and whose backward (``B``, or ``W`` when split) has not; 0
    for forward-only schedules.

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> result = simulate(gpipe(2, 2))
        >>> result.makespan, result.busy, result.idle, result.bubble_fraction
        (9.0, (6.0, 6.0), (3.0, 3.0), 0.3333333333333333)
    """

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    timeline: tuple[TimedAction, ...]

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return len(self.busy)

    def to_dict(self, *, timeline: bool = True) -> dict[str, Any]:
        """The result as JSON-ready data; actions in their compact form (``0F3``).

        Example:
            >>> from pipetrain.schedule.gpipe import gpipe
            >>> simulate(gpipe(2, 2)).to_dict(timeline=False)["bubble_fraction"]
            0.3333333333333333
        """
        data: dict[str, Any] = {
            "makespan": self.makespan,
            "busy": list(self.busy),
            "idle": list(self.idle),
            "bubble_fraction": self.bubble_fraction,
            "peak_activations": list(self.peak_activations),
        }
        if timeline:
            data["timeline"] = [
                {"rank": t.rank, "action": str(t.action), "start": t.start, "end": t.end}
                for t in self.timeline
            ]
        return data


def simulate(schedule: Schedule, costs: Costs = DEFAULT_COSTS) -> SimulationResult:
    """Time ``schedule`` under ``costs`` (see :mod:`pipetrain.schedule.execution`).

    Example:
        >>> from pipetrain.schedule.one_f_one_b import one_f_one_b
        >>> result = simulate(one_f_one_b(4, 8))
        >>> result.makespan, round(result.bubble_fraction, 4), result.peak_activations
        (33.0, 0.2727, (4, 3, 2, 1))

    Raises:
        ScheduleError: the schedule deadlocks.
        ValueError: per-stage costs do not have one value per stage.
    """
    execution = execute(schedule, costs.per_stage(schedule.num_stages))
    if execution.blocked:
        raise ScheduleError(schedule, deadlock_problems(schedule, execution.blocked))
    makespan = max((t.end for t in execution.timeline), default=0.0)
    busy = [0.0] * schedule.num_ranks
    for t in execution.timeline:
        if t.action.op.is_compute or t.action.op is Op.OPTIMIZER_STEP:
            busy[t.rank] += t.end - t.start
    idle = tuple(makespan - b for b in busy)
    total = schedule.num_ranks * makespan
    return SimulationResult(
        makespan=makespan,
        busy=tuple(busy),
        idle=idle,
        bubble_fraction=sum(idle) / total if total > 0 else 0.0,
        peak_activations=_peak_activations(schedule),
        timeline=execution.timeline,
    )


def _peak_activations(schedule: Schedule) -> tuple[int, ...]:
    if not schedule.is_training:
        return (0,) * schedule.num_ranks
    peaks = []
    for actions in schedule.actions:
        held = peak = 0
        for a in actions:
            if a.op is Op.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.op is Op.BACKWARD or a.op is Op.BACKWARD_WEIGHT:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)
