"""The text grid: one row per rank, one column per clock tick, one cell per action."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pipetrain.schedule.actions import Action
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.execution import TimedAction, execute
from pipetrain.schedule.program import Schedule


class TimedRun(Protocol):
    """What :func:`render_grid` reads of a simulation result."""

    timeline: tuple[TimedAction, ...]
    num_ranks: int

__all__ = ["UNIT_COSTS", "TimedRun", "action_label", "render_grid"]

UNIT_COSTS = Costs(forward=1, backward=1, backward_input=1, backward_weight=1)
"""Every compute action takes one clock tick; messages arrive at once."""


def render_grid(
    source: Schedule | TimedRun | Iterable[TimedAction], *, tick: float | None = None
) -> str:
    """A rank x clock-tick text grid of the compute actions (``.`` where a rank idles).

    A :class:`Schedule` is run with :data:`UNIT_COSTS`, so each compute action is one
    column (``tick`` is ignored). A simulation result or a timeline (simulated or
    measured, any float times) is laid out from its earliest action with ``tick`` time
    units per column (default: its shortest compute action); an action longer than one
    tick continues with ``-`` cells. Cells are ``F3``, ``B2``, ``I1``, ``W0``; when a rank
    runs a stage other than its own number (several stages per rank) they name the
    stage too (``2F3``). A schedule that deadlocks shows what ran before it got stuck.

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> from pipetrain.schedule.simulate import simulate
        >>> print(render_grid(simulate(gpipe(2, 2), Costs(forward=1, backward=2))))
        rank 0: F0 F1 .  .  .  B0 -- B1 --
        rank 1: .  F0 F1 B0 -- B1 --
    """
    if isinstance(source, Schedule):
        timeline: tuple[TimedAction, ...] = execute(
            source, UNIT_COSTS.per_stage(source.num_stages)
        ).timeline
        num_ranks = source.num_ranks
        tick = 1.0
    elif hasattr(source, "timeline") and hasattr(source, "num_ranks"):  # a simulation result
        timeline, num_ranks = tuple(source.timeline), int(source.num_ranks)
    else:
        timeline = tuple(source)
        num_ranks = max((t.rank + 1 for t in timeline), default=0)
    origin = min((t.start for t in timeline), default=0.0)
    compute = [t for t in timeline if t.action.op.is_compute]
    if tick is None:
        tick = min((t.end - t.start for t in compute if t.end > t.start), default=1.0)
    if not tick > 0:
        raise ValueError(f"tick must be positive, got {tick!r}")
    with_stage = any(t.action.stage != t.rank for t in compute)
    rows: list[list[str]] = [[] for _ in range(num_ranks)]
    for t in sorted(compute, key=lambda t: (t.rank, t.start, t.end)):
        row = rows[t.rank]
        column = max(round((t.start - origin) / tick), len(row))
        width = max(1, round((t.end - t.start) / tick))
        row += ["."] * (column - len(row)) + [action_label(t.action, with_stage=with_stage)]
        row += ["-"] * (width - 1)
    cell = max((len(c) for row in rows for c in row), default=1)
    margin = len(str(max(num_ranks - 1, 0)))
    lines = []
    for r, row in enumerate(rows):
        cells = " ".join(c * cell if c == "-" else c.ljust(cell) for c in row)
        lines.append(f"rank {r:>{margin}}: {cells}".rstrip())
    return "\n".join(lines)


def action_label(action: Action, *, with_stage: bool) -> str:
    """A compute action's cell: ``F3``, or ``2F3`` with the stage.

    Example:
        >>> from pipetrain.schedule.actions import parse_action
        >>> action_label(parse_action("2F3"), with_stage=False)
        'F3'
    """
    text = str(action)
    return text if with_stage else text.lstrip("0123456789")
