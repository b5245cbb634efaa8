"""The pictures of ``pipetrain bench``: grouped bar charts and line charts as PNG files.

A case draws from the figures of its tables and returns the file names in
:attr:`~pipetrain.bench.case.BenchResult.plots`; ``docs/benchmarks.md`` shows them (a
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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bar_chart", "line_chart"]


def _figure(title: str, width: float = 8.0, height: float = 4.5) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    axes = figure.add_subplot(1, 1, 1)
    axes.set_title(title, fontsize=10)
    axes.grid(axis="y", alpha=0.3)
    return figure, axes


def _save(figure: Any, path: Path) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(path))
    return path.name


def bar_chart(path: Path, *, title: str, categories: Sequence[str],
              series: Mapping[str, Sequence[float | None]], ylabel: str,
              reference: float | None = None, log: bool = False) -> str:
    """Draw grouped bars (one group per category, one bar per series; ``None``: no bar)
    into ``path``; its file name. ``reference`` draws a dashed horizontal line (e.g. 1.0
    for a ratio).

    Raises:
        ValueError: a series has not one value per category.
    """
    for name, values in series.items():
        if len(values) != len(categories):
            raise ValueError(f"series {name!r} has {len(values)} values for "
                             f"{len(categories)} categories")
    figure, axes = _figure(title, width=max(6.0, 0.9 * len(categories) * max(1, len(series))))
    count = max(1, len(series))
    width = 0.8 / count
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        ys = [float(v) for v in values if v is not None]
        axes.bar(xs, ys, width=width, label=name)
    axes.set_xticks(range(len(categories)))
    axes.set_xticklabels(categories, rotation=20 if len(categories) > 4 else 0, ha="right"
                         if len(categories) > 4 else "center", fontsize=8)
    axes.set_ylabel(ylabel)
    if log:
        axes.set_yscale("log")
    if reference is not None:
        axes.axhline(reference, color="black", linestyle="--", linewidth=0.8)
    if len(series) > 1:
        axes.legend(fontsize=8)
    return _save(figure, path)


def line_chart(path: Path, *, title: str, x: Sequence[float],
               series: Mapping[str, Sequence[float | None]], xlabel: str, ylabel: str,
               log_x: bool = False, log_y: bool = False) -> str:
    """Draw one line per series over ``x`` (``None``: a gap) into ``path``; its file name.

    Raises:
        ValueError: a series has not one value per x.
    """
    figure, axes = _figure(title)
    for name, values in series.items():
        if len(values) != len(x):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(x)} x values")
        points = [(a, float(b)) for a, b in zip(x, values) if b is not None]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if log_x:
        axes.set_xscale("log", base=2)
    if log_y:
        axes.set_yscale("log")
    axes.legend(fontsize=8)
    return _save(figure, path)
