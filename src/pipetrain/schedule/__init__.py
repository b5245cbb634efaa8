"""Schedules as data: the action IR, generators, validation, simulation and rendering.

Pure Python: nothing in this package imports torch (matplotlib is imported only when
:func:`render_timeline` draws).

Example:
    >>> from pipetrain.schedule import build_schedule, simulate, Costs
    >>> s = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    >>> round(simulate(s, Costs(forward=1, backward=2)).bubble_fraction, 3)
    0.273
"""

from pipetrain.schedule.actions import (
    COMMUNICATION_OPS,
    COMPUTE_OPS,
    Action,
    Op,
    format_actions,
    parse_action,
    parse_actions,
)
from pipetrain.schedule.async_stream import ASYNC_SCHEDULES, AsyncStream
from pipetrain.schedule.costs import Costs, StageCosts
from pipetrain.schedule.execution import TimedAction
from pipetrain.schedule.forward_only import forward_only
from pipetrain.schedule.gpipe import gpipe
from pipetrain.schedule.grid import render_grid
from pipetrain.schedule.interleaved import interleaved_1f1b
from pipetrain.schedule.lowering import add_communication, add_optimizer_step
from pipetrain.schedule.one_f_one_b import one_f_one_b
from pipetrain.schedule.pipedream import pipedream
from pipetrain.schedule.program import Schedule, loop_placement, v_placement
from pipetrain.schedule.registry import (
    SCHEDULE_ALIASES,
    SCHEDULE_NAMES,
    TRAINING_SCHEDULES,
    build_schedule,
    canonical_name,
    get_generator,
)
from pipetrain.schedule.simulate import SimulationResult, simulate
from pipetrain.schedule.steady_state import SteadyState, steady_state
from pipetrain.schedule.timeline import render_timeline
from pipetrain.schedule.two_bw import two_bw
from pipetrain.schedule.validate import ScheduleError, find_problems, validate
from pipetrain.schedule.versions import is_versioned, version_problems, versions_held
from pipetrain.schedule.zero_bubble import zb_h1

__all__ = [
    "ASYNC_SCHEDULES",
    "COMMUNICATION_OPS",
    "COMPUTE_OPS",
    "SCHEDULE_ALIASES",
    "SCHEDULE_NAMES",
    "TRAINING_SCHEDULES",
    "Action",
    "AsyncStream",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "StageCosts",
    "SteadyState",
    "TimedAction",
    "add_communication",
    "add_optimizer_step",
    "build_schedule",
    "canonical_name",
    "find_problems",
    "format_actions",
    "forward_only",
    "get_generator",
    "gpipe",
    "interleaved_1f1b",
    "is_versioned",
    "loop_placement",
    "one_f_one_b",
    "parse_action",
    "parse_actions",
    "pipedream",
    "render_grid",
    "render_timeline",
    "simulate",
    "steady_state",
    "two_bw",
    "v_placement",
    "validate",
    "version_problems",
    "versions_held",
    "zb_h1",
]
