"""Schedules as data: the action IR, generators, validation, simulation and rendering.

Pure Python: nothing in this package imports torch.
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
from pipetrain.schedule.program import Schedule, loop_placement, v_placement

__all__ = [
    "COMMUNICATION_OPS",
    "COMPUTE_OPS",
    "Action",
    "Op",
    "Schedule",
    "format_actions",
    "loop_placement",
    "parse_action",
    "parse_actions",
    "v_placement",
]
