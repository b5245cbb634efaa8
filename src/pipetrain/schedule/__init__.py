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
from pipetrain.schedule.dualpipe_v import dualpipe_v
from pipetrain.schedule.execution import TimedAction
from pipetrain.schedule.forward_only import forward_only
from pipetrain.schedule.fsdp_costs import fsdp_policy_costs
from pipetrain.schedule.gpipe import gpipe
from pipetrain.schedule.grid import render_grid
from pipetrain.schedule.interleaved import interleaved_1f1b
from pipetrain.schedule.looped_bfs import looped_bfs
from pipetrain.schedule.lowering import (
    add_communication,
    add_fsdp_actions,
    add_optimizer_step,
    complete_lowering,
)
from pipetrain.schedule.memory import ActivationPeaks, StageBytes, activation_peaks
from pipetrain.schedule.one_f_one_b import one_f_one_b
from pipetrain.schedule.pipedream import pipedream
from pipetrain.schedule.program import Schedule, loop_placement, v_placement
from pipetrain.schedule.registry import (
    SCHEDULE_ALIASES,
    SCHEDULE_NAMES,
    TRAINING_SCHEDULES,
    V_SCHEDULES,
    build_schedule,
    canonical_name,
    default_stages_per_rank,
    get_generator,
    schedule_placement,
    stages_per_rank_range,
)
from pipetrain.schedule.schedule_file import load_schedule, parse_schedule
from pipetrain.schedule.simulate import SimulationResult, simulate
from pipetrain.schedule.steady_state import SteadyState, steady_state
from pipetrain.schedule.timeline import render_timeline
from pipetrain.schedule.two_bw import two_bw
from pipetrain.schedule.v_memory import v_capped, v_half, v_min
from pipetrain.schedule.validate import ScheduleError, find_problems, validate
from pipetrain.schedule.versions import is_versioned, version_problems, versions_held
from pipetrain.schedule.zb_h2 import zb_h2
from pipetrain.schedule.zb_v import zb_v
from pipetrain.schedule.zero_bubble import zb_h1

__all__ = [
    "ASYNC_SCHEDULES",
    "COMMUNICATION_OPS",
    "COMPUTE_OPS",
    "SCHEDULE_ALIASES",
    "SCHEDULE_NAMES",
    "TRAINING_SCHEDULES",
    "V_SCHEDULES",
    "Action",
    "ActivationPeaks",
    "AsyncStream",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "StageBytes",
    "StageCosts",
    "SteadyState",
    "TimedAction",
    "activation_peaks",
    "add_communication",
    "add_fsdp_actions",
    "add_optimizer_step",
    "build_schedule",
    "canonical_name",
    "complete_lowering",
    "default_stages_per_rank",
    "dualpipe_v",
    "find_problems",
    "format_actions",
    "forward_only",
    "fsdp_policy_costs",
    "get_generator",
    "gpipe",
    "interleaved_1f1b",
    "is_versioned",
    "load_schedule",
    "loop_placement",
    "looped_bfs",
    "one_f_one_b",
    "parse_action",
    "parse_actions",
    "parse_schedule",
    "pipedream",
    "render_grid",
    "render_timeline",
    "schedule_placement",
    "simulate",
    "stages_per_rank_range",
    "steady_state",
    "two_bw",
    "v_capped",
    "v_half",
    "v_min",
    "v_placement",
    "validate",
    "version_problems",
    "versions_held",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
