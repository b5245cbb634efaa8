"""What a benchmark case is: its settings in, its tables, plots and data out.

Example (a case module, ``pipetrain/bench/cases/example.py``)::

    from pipetrain.bench.case import BenchContext, BenchResult, Case, Table

    def run(context: BenchContext) -> BenchResult:
        reps = 5 if context.quick else 30
        context.progress(f"timing {reps} repetitions")
        ...
        table = Table(title="GPipe vs torchgpipe", columns=["model", "pipetrain", "torchgpipe", "ratio"],
                      rows=[["MLP", "39.7 ms", "56.1 ms", "1.41x"]],
                      anchor="torchgpipe 0.0.7, same process kind, interleaved")
        return BenchResult(tables=[table], data={"ratio": 1.41})

    def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
        return [bar_chart(out / "example_ratio.png", title="pipetrain / torchgpipe",
                          categories=texts(tables[0], "model"),
                          series={"ratio": numbers(tables[0], "ratio")}, ylabel="ratio")]

    CASE = Case(name="example", title="An example", run=run, draw=draw, quick_seconds=20,
                full_seconds=120)

``draw`` reads only the tables and data (as a result file holds them, after a JSON round
trip), so that ``python -m pipetrain.bench.redraw RESULTS_DIR`` draws the pictures again
without measuring (:mod:`pipetrain.bench.drawings` reads the tables' cells).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchContext", "BenchResult", "Case", "Draw", "SkipCase", "Table"]


@dataclass(frozen=True, kw_only=True)
class Table:
    """One table of a case: pipetrain's figures beside the anchors' (and the paper's).

    ``anchor`` says what the figures are compared with, measured in the same run (or the
    paper and where its figure is from); ``notes`` says where and why they differ.
    ``key`` names the table within its case, for a doc block that shows this table
    alone (``<!-- bench:CASE/KEY:begin -->``, see :mod:`pipetrain.bench.docs`).
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    anchor: str = ""
    notes: str = ""
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The table as JSON-ready data (what :meth:`from_dict` reads back)."""
        return {"title": self.title, "columns": self.columns, "rows": self.rows,
                "anchor": self.anchor, "notes": self.notes, "key": self.key}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Table:
        """A table from :meth:`to_dict`'s data (a result file of ``pipetrain bench``).

        Example:
            >>> Table.from_dict(Table(title="t", columns=["a"], rows=[[1]]).to_dict()).rows
            [[1]]
        """
        return cls(title=data["title"], columns=list(data["columns"]),
                   rows=[list(row) for row in data["rows"]], anchor=data.get("anchor", ""),
                   notes=data.get("notes", ""), key=data.get("key", ""))

    def markdown(self) -> str:
        """The table as Markdown (with its anchor and notes below it).

        Example:
            >>> print(Table(title="t", columns=["a", "b"], rows=[[1, 2.5]]).markdown())
            | a | b |
            |---|---|
            | 1 | 2.5 |
        """
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in self.rows]
        extra = [text for text in (self.anchor and f"Anchor: {self.anchor}.", self.notes) if text]
        return "\n\n".join(["\n".join(lines), *extra])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


@dataclass(kw_only=True)
class BenchResult:
    """What a case returns: its tables, the PNGs it wrote (file names in the output
    folder) and its raw data (JSON-ready)."""

    tables: list[Table]
    plots: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BenchContext:
    """A case's settings: the size (``quick``), the folder it writes plots into, and how
    to say what it is doing (one line per step, on stderr)."""

    quick: bool
    out: Path
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr)  # noqa: T201


class SkipCase(Exception):
    """Raised by a case's ``run`` when it cannot run here (data it needs is absent): the
    suite records the case as skipped, with the message as the reason.

    Example::

        if not profiles.is_dir():
            raise SkipCase(f"PipeDream's profiles are not in {profiles}")
    """


Draw = Callable[[list[Table], dict[str, Any], Path], list[str]]
"""A case's pictures: ``draw(tables, data, out)`` writes PNG files into ``out`` from the
tables and data of its result (as recorded) and returns their file names."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """A benchmark: its name (``pipetrain bench NAME``), a title, the function that runs
    it, and its expected duration on a 2-core CPU (seconds, quick and full); optionally
    the function that draws its pictures from its tables and data (:data:`Draw`)."""

    name: str
    title: str
    run: Callable[[BenchContext], BenchResult]
    quick_seconds: float
    full_seconds: float
    needs: tuple[str, ...] = ()
    """Optional packages it needs (``torchgpipe``...); missing ones skip it, with the reason."""
    draw: Draw | None = None
    """Draws the case's PNG pictures from its recorded tables and data (the suite calls it
    after a run that succeeded; :mod:`pipetrain.bench.redraw` from a result file)."""
