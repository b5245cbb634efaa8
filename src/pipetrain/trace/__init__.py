"""What the runtime recorded, made visible: Chrome trace, timeline PNG, measured bubble.

Reads the :class:`~pipetrain.schedule.TimedAction` the runtime records per executed
action (seconds since a step origin shared by all ranks; see
:mod:`pipetrain.trace.recorded` for the clock conventions). Imports only
:mod:`pipetrain.schedule` and the standard library (matplotlib lazily, when a picture is
drawn), so it stays cheap to import.

Example:
    >>> from pipetrain.schedule import build_schedule, simulate, Costs
    >>> from pipetrain.trace import measure_step, chrome_trace
    >>> result = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8))
    >>> measure = measure_step(result.timeline)
    >>> measure.bubble_fraction == result.bubble_fraction
    True
    >>> len(chrome_trace([result.timeline])["traceEvents"]) > 64
    True
"""

from pipetrain.trace.chrome import CATEGORIES, chrome_trace, write_chrome_trace
from pipetrain.trace.measure import COST_NAMES, StepMeasure, aggregate, measure_step
from pipetrain.trace.progress import ProgressBar, format_duration, format_rate
from pipetrain.trace.recorded import align_ranks, check_timeline, offsets_from_origins
from pipetrain.trace.timeline import render_measured_timeline

__all__ = [
    "CATEGORIES",
    "COST_NAMES",
    "ProgressBar",
    "StepMeasure",
    "aggregate",
    "align_ranks",
    "check_timeline",
    "chrome_trace",
    "format_duration",
    "format_rate",
    "measure_step",
    "offsets_from_origins",
    "render_measured_timeline",
    "write_chrome_trace",
]
