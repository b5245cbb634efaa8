"""The timeline picture: one row per rank, one box per action, coloured by op (PNG)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

from pipetrain.schedule.actions import Op
from pipetrain.schedule.execution import TimedAction
from pipetrain.schedule.grid import action_label

__all__ = ["OP_COLORS", "WAIT_COLOR", "render_timeline"]

OP_COLORS = {
    Op.FORWARD: "#4878d0",
    Op.BACKWARD: "#ee854a",
    Op.BACKWARD_INPUT: "#3fa34d",
    Op.BACKWARD_WEIGHT: "#956cb4",
    Op.REDUCE_GRAD: "#8c613c",
    Op.UNSHARD: "#17becf",
    Op.OPTIMIZER_STEP: "#d62728",
}
"""Box colour of each op drawn (sends are not drawn; receives only as waits)."""
WAIT_COLOR = "#7f7f7f"
"""Hatch colour of the time a rank waited in a receive (``waits=True``)."""
_RECEIVES = (Op.RECV_FORWARD, Op.RECV_BACKWARD)
_BACKGROUND = (Op.REDUCE_GRAD, Op.UNSHARD)  # collectives drawn as thin bars

_NAMES = {
    Op.FORWARD: "F forward",
    Op.BACKWARD: "B backward",
    Op.BACKWARD_INPUT: "I backward (inputs)",
    Op.BACKWARD_WEIGHT: "W backward (weights)",
    Op.REDUCE_GRAD: "REDUCE gradient reduction",
    Op.UNSHARD: "UNSHARD all-gather (FSDP)",
    Op.OPTIMIZER_STEP: "STEP optimizer",
}
_LEFT, _RIGHT = 0.6, 0.3  # figure margins, inches
_FONT_SIZE = 7.0


def render_timeline(
    timeline: Iterable[TimedAction],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    time_unit: str = "",
    waits: bool = False,
) -> None:
    """Draw a timeline (simulated, or measured with any float times) to a PNG file.

    One row per rank (rank 0 on top); a box per compute action, ``REDUCE`` and FSDP's
    ``UNSHARD`` (thin bars along the bottom of the row, as they run in the background;
    ``RESHARD`` takes no time and is not drawn) and ``STEP``, coloured
    by op and labelled like the text grid (``F3``, or ``2F3`` with several stages per
    rank) where the whole label fits (a box too small for it stays unlabelled: never a
    fragment); the legend names every colour, the empty (idle) time too. Sends are not drawn;
    receives are drawn only with ``waits=True``, as hatched boxes over the time the rank
    waited for its message (useful for measured timelines). Time starts at the earliest
    action drawn.

    Example:
        >>> import tempfile, pathlib
        >>> from pipetrain.schedule.one_f_one_b import one_f_one_b
        >>> from pipetrain.schedule.simulate import simulate
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "1f1b.png"
        >>> render_timeline(simulate(one_f_one_b(4, 8)).timeline, path, title="1F1B")
        >>> path.read_bytes()[:4] == b"\\x89PNG"
        True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    timeline = tuple(timeline)
    boxes = [t for t in timeline if t.action.op in OP_COLORS]
    waited = [t for t in timeline if waits and t.action.op in _RECEIVES and t.end > t.start]
    drawn = boxes + waited
    num_ranks = max((t.rank + 1 for t in drawn), default=1)
    origin = min((t.start for t in drawn), default=0.0)
    span = max((t.end - origin for t in drawn), default=1.0) or 1.0
    per_rank: dict[int, int] = defaultdict(int)
    for t in boxes:
        per_rank[t.rank] += 1
    width = min(max(8.0, 0.3 * max(per_rank.values(), default=0) + 2.0), 60.0)
    height = 1.6 + 0.45 * num_ranks
    num_entries = len({t.action.op for t in boxes}) + (1 if waited else 0) + 1  # + idle
    columns = min(num_entries, max(3, int(width / 1.7)))
    legend_rows = -(-num_entries // columns)
    height += 0.2 * (legend_rows - 1)
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    top = 0.7 + 0.2 * (legend_rows - 1)
    figure.subplots_adjust(
        left=_LEFT / width, right=1 - _RIGHT / width, bottom=0.9 / height, top=1 - top / height
    )
    axes = figure.add_subplot()
    points_per_unit = (width - _LEFT - _RIGHT) * 72 / span
    with_stage = any(t.action.stage != t.rank for t in drawn if t.action.op.is_compute)
    for rank in sorted({t.rank for t in waited}):
        axes.broken_barh(
            [(t.start - origin, t.end - t.start) for t in waited if t.rank == rank],
            (rank - 0.4, 0.8),
            facecolors="white",
            edgecolor=WAIT_COLOR,
            hatch="////",
            linewidth=0.5,
        )
    bars: dict[Op, list[tuple[int, float, float]]] = defaultdict(list)
    for t in boxes:
        start, duration = t.start - origin, t.end - t.start
        bars[t.action.op].append((t.rank, start, duration))
        if not t.action.op.is_compute or t.action.microbatch is None:
            continue
        label = action_label(t.action, with_stage=with_stage)
        if len(label) * 0.62 * _FONT_SIZE + 2 <= duration * points_per_unit:
            axes.text(
                start + duration / 2,
                t.rank,
                label,
                ha="center",
                va="center",
                fontsize=_FONT_SIZE,
                color="white",
                clip_on=True,
            )
    for op, items in bars.items():
        low, thick = (0.22, 0.16) if op in _BACKGROUND else (-0.4, 0.8)
        for rank in {r for r, _, _ in items}:
            axes.broken_barh(
                [(s, d) for r, s, d in items if r == rank],
                (rank + low, thick),
                facecolors=OP_COLORS[op],
                edgecolor="white",
                linewidth=0.5,
            )
    axes.set_xlim(0, span)
    axes.set_ylim(num_ranks - 0.5, -0.5)
    axes.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    axes.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    handles = [Patch(color=OP_COLORS[op], label=_NAMES[op]) for op in OP_COLORS if op in bars]
    if waited:
        handles.append(
            Patch(facecolor="white", edgecolor=WAIT_COLOR, hatch="////", label="RF/RB wait")
        )
    handles.append(Patch(facecolor="white", edgecolor=WAIT_COLOR, linewidth=0.5, label="idle"))
    axes.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0, 1.0),
        ncol=columns,
        fontsize=8,
        frameon=False,
    )
    if title:
        figure.suptitle(title, x=_LEFT / width, ha="left", fontsize=10)
    figure.savefig(os.fspath(path), format="png")
