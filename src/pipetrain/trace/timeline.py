"""The measured timeline picture: one recorded step drawn like the simulator's (PNG)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from pipetrain.schedule import TimedAction, render_timeline
from pipetrain.trace.measure import measure_step
from pipetrain.trace.recorded import check_timeline

__all__ = ["render_measured_timeline"]

_MILLISECONDS = 1e3


def render_measured_timeline(
    timeline: Iterable[TimedAction],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> None:
    """Draw one recorded step (every rank's actions, seconds, one axis) to a PNG file.

    The same picture as :func:`pipetrain.schedule.render_timeline` draws for a
    simulation, with the time in milliseconds from the step's first action and the time
    each rank waited in a receive (``RF``/``RB``) hatched. ``title`` defaults to the
    step's measured makespan and bubble.

    Example:
        >>> import tempfile, pathlib
        >>> from pipetrain.schedule import parse_action
        >>> step = [TimedAction(0, parse_action("0F0"), 0.0, 0.004),
        ...         TimedAction(0, parse_action("0SF0"), 0.004, 0.004),
        ...         TimedAction(1, parse_action("1RF0"), 0.0, 0.0045),
        ...         TimedAction(1, parse_action("1F0"), 0.0045, 0.0085)]
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "step.png"
        >>> render_measured_timeline(step, path)
        >>> path.read_bytes()[:4] == b"\\x89PNG"
        True

    Raises:
        ValueError: an invalid action (see :func:`~pipetrain.trace.check_timeline`).
    """
    actions = check_timeline(timeline)
    if title is None:
        measure = measure_step(actions)
        makespan = measure.makespan * _MILLISECONDS
        shown = f"{makespan:.3g}" if makespan < 100 else f"{makespan:.0f}"
        title = f"measured step: makespan {shown} ms, bubble {measure.bubble_fraction:.1%}"
    scaled = [
        TimedAction(t.rank, t.action, t.start * _MILLISECONDS, t.end * _MILLISECONDS)
        for t in actions
    ]
    render_timeline(scaled, path, title=title, time_unit="ms", waits=True)
