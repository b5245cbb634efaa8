"""The pictures of ``pipetrain bench``: grouped bar charts and line charts as PNG files.

A case's :attr:`~pipetrain.bench.case.Case.draw` draws from the figures of its tables
(:mod:`pipetrain.bench.drawings` reads them) and returns the file names, which the suite
records in the result's ``plots``; ``docs/benchmarks.md`` shows them (a
``<!-- bench:NAME/plots:begin -->`` block). matplotlib is imported only when a picture is
drawn (the Agg backend: no display needed).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> bar_chart(folder / "x.png", title="steps", categories=["gpipe", "1f1b"],
    ...           series={"pipetrain": [1.0, 1.2], "torch": [0.9, 1.0]}, ylabel="ratio")
    'x.png'
    >>> (folder / "x.png").stat().st_size > 0
    True
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bar_chart", "line_chart"]


def _figure(title: str, width: float = 8.0, height: float = 4.5) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    axes = figure.add_subplot(1, 1, 1)
    axes.set_title("\n".join(textwrap.wrap(title, width=int(12 * width))), fontsize=10)
    axes.grid(axis="y", alpha=0.3)
    return figure, axes


def _save(figure: Any, path: Path) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.tight_layout()
    FigureCanvasAgg(figure)  # attaches itself to the figure: savefig draws with Agg
    figure.savefig(str(path), format="png")
    return path.name


def bar_chart(path: Path, *, title: str, categories: Sequence[str],
              series: Mapping[str, Sequence[float | None]], ylabel: str,
              reference: float | None = None, reference_label: str | None = None,
              log: bool = False, floor: float | None = None) -> str:
    """Draw grouped bars (one group per category, one bar per series; ``None``: no bar)
    into ``path``; its file name. ``reference`` draws a dashed horizontal line (e.g. 1.0
    for a ratio; ``reference_label`` names it in the legend). ``floor`` cuts the axis
    there: a bar below it is drawn down to it and labelled with its value.

    Raises:
        ValueError: a series has not one value per category.
    """
    for name, values in series.items():
        if len(values) != len(categories):
            raise ValueError(f"series {name!r} has {len(values)} values for "
                             f"{len(categories)} categories")
    figure, axes = _figure(title, width=min(16.0, max(6.0, 0.9 * len(categories)
                                                           * max(1, len(series)))))
    count = max(1, len(series))
    width = 0.8 / count
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        ys = [float(v) for v in values if v is not None]
        shown = ys if floor is None else [max(y, floor) for y in ys]
        axes.bar(xs, shown, width=width, label=name)
        for x, y, bar in zip(xs, ys, shown):
            if y != bar:
                axes.annotate(f"{y:.4g}", (x, bar), ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(len(categories)))
    axes.set_xticklabels(categories, rotation=20 if len(categories) > 4 else 0, ha="right"
                         if len(categories) > 4 else "center", fontsize=8)
    axes.set_ylabel(ylabel)
    if log:
        axes.set_yscale("log")
    if reference is not None:
        axes.axhline(reference, color="black", linestyle="--", linewidth=0.8,
                     label=reference_label)
    if floor is not None:
        axes.set_ylim(bottom=floor)
    if len(series) > 1 or reference_label is not None:
        axes.legend(fontsize=8)
    return _save(figure, path)


def line_chart(path: Path, *, title: str, x: Sequence[float],
               series: Mapping[str, Sequence[float | None]], xlabel: str, ylabel: str,
               log_x: bool = False, log_y: bool = False,
               styles: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Draw one line per series over ``x`` (``None``: a gap) into ``path``; its file name.
    ``styles`` gives a series matplotlib's line options (``{"color": "C1", "linestyle":
    "--"}``), e.g. one color per group and one line style per source.

    Raises:
        ValueError: a series has not one value per x.
    """
    figure, axes = _figure(title)
    for name, values in series.items():
        if len(values) != len(x):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(x)} x values")
        points = [(a, float(b)) for a, b in zip(x, values) if b is not None]
        style = {"marker": "o", **(styles or {}).get(name, {})}
        axes.plot([p[0] for p in points], [p[1] for p in points], label=name, **style)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if log_x:
        axes.set_xscale("log", base=2)
    if log_y:
        axes.set_yscale("log")
    axes.legend(fontsize=8)
    return _save(figure, path)
