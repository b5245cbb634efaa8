"""User-defined schedules in a pipeline: a Schedule object or a schedule file, checked
against the rest of the configuration.

``PipelineConfig(schedule=...)`` takes a schedule name, a path to a schedule file (the
text ``print(schedule)`` gives, see :mod:`pipetrain.schedule.schedule_file`) or a
:class:`~pipetrain.schedule.Schedule`. A user schedule is lowered where it leaves
things out (:func:`~pipetrain.schedule.complete_lowering`: sends, receives, the
optimizer step), validated (a deadlock or a missing action is refused with the
validator's grid), and then runs as written: its ranks are the pipeline's ranks, its
placement the model stages' placement, its micro-batch count the step's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from pipetrain.schedule import (
    Schedule,
    ScheduleError,
    canonical_name,
    complete_lowering,
    load_schedule,
    validate,
)

__all__ = ["is_schedule_file", "resolve_user_schedule", "user_schedule_problems"]


def is_schedule_file(value: object) -> bool:
    """Whether ``value`` names a schedule file rather than a schedule: a path-like
    object, or a string that is no schedule name and names an existing file.

    Example:
        >>> is_schedule_file("1f1b"), is_schedule_file("no/such/file.txt")
        (False, False)
    """
    if isinstance(value, os.PathLike):
        return True
    if not isinstance(value, str):
        return False
    try:
        canonical_name(value)
    except ValueError:
        return os.path.isfile(value)
    return False


def resolve_user_schedule(value: object) -> Schedule | None:
    """The runnable schedule of a user schedule (a file or a Schedule), lowered as far
    as needed and validated; ``None`` for a schedule name.

    Example:
        >>> from pipetrain.schedule import parse_schedule
        >>> mine = parse_schedule("rank 0: 0F0 0B0\\nrank 1: 1F0 1B0", name="mine")
        >>> print(resolve_user_schedule(mine))
        rank 0: 0F0 0SF0 0RB0 0B0 0REDUCE 0STEP
        rank 1: 1RF0 1F0 1B0 1SB0 1REDUCE 1STEP
        >>> resolve_user_schedule("zb-v") is None
        True

    Raises:
        OSError: the file cannot be read.
        ValueError: the text is not a schedule, or the schedule cannot run
            (:class:`~pipetrain.schedule.ScheduleError`, with the grid).
    """
    if isinstance(value, Schedule):
        schedule = value
    elif is_schedule_file(value):
        schedule = load_schedule(value)  # type: ignore[arg-type]
    else:
        return None
    try:  # a file named after a library schedule ('forward.txt') keeps its own identity
        canonical_name(schedule.name)
    except ValueError:
        pass
    else:
        schedule = schedule.replace_actions(schedule.actions, name=f"user-{schedule.name}")
    lowered = complete_lowering(schedule)
    try:
        validate(lowered)
    except ScheduleError as error:
        if lowered == schedule:
            raise
        raise ValueError(f"{error}\nthe positions count from 0 in the lists as lowered (the "
                         f"library added the sends, receives and steps):\n{lowered}") from None
    return lowered


def user_schedule_problems(schedule: Schedule, values: Mapping[str, Any],
                           say: Callable[[str, Any], str]) -> list[str]:
    """What in the configuration ``values`` does not fit the user schedule, each with its
    fix written by ``say`` (see :data:`~pipetrain.api.config.Spelling`).

    Example:
        >>> from pipetrain.schedule import parse_schedule
        >>> mine = parse_schedule("rank 0: 0F0 0F1 0B0 0B1", name="mine")
        >>> user_schedule_problems(mine, {"num_stages": 1, "stages_per_rank": 1,
        ...     "num_microbatches": 8, "replicas": 1, "stage_replicas": None},
        ...     lambda name, value: f"{name}={value!r}")
        ["num_microbatches=8 but schedule 'mine' runs 2 micro-batches a step; fix: num_microbatches=2"]
    """
    name = schedule.name
    ranks, stages = schedule.num_ranks, schedule.num_stages
    found = []
    if not schedule.is_training:
        found.append(f"schedule {name!r} has no backward (a training schedule needs a B, or an "
                     f"I and a W, for every forward)")
    if values["num_stages"] != ranks:
        found.append(f"{say('num_stages', values['num_stages'])} but schedule {name!r} has "
                     f"{ranks} ranks; fix: {say('num_stages', ranks)}")
    elif stages % ranks:
        counts = [len(schedule.stages_of(r)) for r in range(ranks)]
        found.append(f"schedule {name!r} gives its ranks {counts} stages; a pipeline's ranks "
                     f"hold the same number of stages; fix: the same number on every rank")
    elif values["stages_per_rank"] != stages // ranks:
        found.append(f"{say('stages_per_rank', values['stages_per_rank'])} but schedule "
                     f"{name!r} places {stages} stages on {ranks} ranks; fix: "
                     f"{say('stages_per_rank', stages // ranks)}")
    if values["num_microbatches"] != schedule.num_microbatches:
        found.append(f"{say('num_microbatches', values['num_microbatches'])} but schedule "
                     f"{name!r} runs {schedule.num_microbatches} micro-batches a step; fix: "
                     f"{say('num_microbatches', schedule.num_microbatches)}")
    if values["replicas"] != 1 or values["stage_replicas"] is not None or schedule.replicas:
        found.append(f"schedule {name!r} is written for one replica per stage; fix: "
                     f"{say('replicas', 1)} (and no stage_replicas)")
    return found
