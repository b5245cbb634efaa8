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

__all__ = ["BenchContext", "BenchResult", "Case", "Draw", "Goal", "SkipCase", "Table"]


@dataclass(frozen=True, kw_only=True)
class Goal:
    """A target a table's figure is held to: what, the target, the figure reached, and
    whether it is met (``None``: not measured in this run).

    Example:
        >>> goal = Goal.at_least("gpipe: pipetrain / torch throughput", 1.24, 1.0, unit="x")
        >>> goal.met, goal.text()
        (True, 'gpipe: pipetrain / torch throughput 1.24x (goal >= 1.00x): met')
        >>> Goal.at_most("gpipe: step vs ideal", None, 0.05, unit="%").text()
        'gpipe: step vs ideal - (goal <= 5.0%): not measured'
    """

    name: str
    target: str
    value: str
    met: bool | None

    @classmethod
    def at_least(cls, name: str, value: float | None, bound: float, *, unit: str = "") -> Goal:
        """``value >= bound`` (``unit``: ``"x"`` a ratio, ``"%"`` a fraction shown in %)."""
        return cls(name=name, target=f">= {_figure(bound, unit)}", value=_figure(value, unit),
                   met=None if value is None else value >= bound)

    @classmethod
    def at_most(cls, name: str, value: float | None, bound: float, *, unit: str = "") -> Goal:
        """``value <= bound``."""
        return cls(name=name, target=f"<= {_figure(bound, unit)}", value=_figure(value, unit),
                   met=None if value is None else value <= bound)

    def verdict(self) -> str:
        return "not measured" if self.met is None else "met" if self.met else "MISSED"

    def text(self) -> str:
        """The goal in one phrase: name, figure, target, verdict."""
        return f"{self.name} {self.value} (goal {self.target}): {self.verdict()}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "value": self.value, "met": self.met}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Goal:
        return cls(name=data["name"], target=data["target"], value=data["value"],
                   met=data["met"])


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:.2f}{unit}"


@dataclass(frozen=True, kw_only=True)
class Table:
    """One table of a case: pipetrain's figures beside the anchors' (and the paper's).

    ``anchor`` says what the figures are compared with, measured in the same run (or the
    paper and where its figure is from); ``notes`` says where and why they differ.
    ``key`` names the table within its case, for a doc block that shows this table
    alone (``<!-- bench:CASE/KEY:begin -->``, see :mod:`pipetrain.bench.docs`).
    ``goals`` are the targets its figures are held to: the Markdown says whether each is
    met, and the suite lists the missed ones (:mod:`pipetrain.bench.suite`).
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    anchor: str = ""
    notes: str = ""
    key: str = ""
    goals: list[Goal] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The table as JSON-ready data (what :meth:`from_dict` reads back)."""
        data: dict[str, Any] = {"title": self.title, "columns": self.columns, "rows": self.rows,
                "anchor": self.anchor, "notes": self.notes, "key": self.key}
        if self.goals:
            data["goals"] = [g.to_dict() for g in self.goals]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Table:
        """A table from :meth:`to_dict`'s data (a result file of ``pipetrain bench``).

        Example:
            >>> Table.from_dict(Table(title="t", columns=["a"], rows=[[1]]).to_dict()).rows
            [[1]]
        """
        return cls(title=data["title"], columns=list(data["columns"]),
                   rows=[list(row) for row in data["rows"]], anchor=data.get("anchor", ""),
                   notes=data.get("notes", ""), key=data.get("key", ""),
                   goals=[Goal.from_dict(g) for g in data.get("goals", [])])

    def markdown(self) -> str:
        """The table as Markdown (with its anchor, notes and goals below it).

        Example:
            >>> print(Table(title="t", columns=["a", "b"], rows=[[1, 2.5]]).markdown())
            | a | b |
            |---|---|
            | 1 | 2.5 |
            >>> goal = Goal.at_least("b", 2.5, 3.0)
            >>> print(Table(title="t", columns=["b"], rows=[[2.5]], goals=[goal]).markdown())
            | b |
            |---|
            | 2.5 |
            <BLANKLINE>
            Goals: b 2.50 (goal >= 3.00): MISSED.
        """
        lines = ["| " + " | ".join(_cell(c) for c in self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in self.rows]
        goals = self.goals and "Goals: " + "; ".join(g.text() for g in self.goals) + "."
        extra = [text for text in (self.anchor and f"Anchor: {self.anchor}.", self.notes, goals)
                 if text]
        return "\n\n".join(["\n".join(lines), *extra])

    def missed(self) -> list[Goal]:
        """The goals this table's figures missed."""
        return [g for g in self.goals if g.met is False]


def _cell(value: Any) -> str:
    """A table cell as Markdown: a float to 4 digits, a ``|`` escaped (it would end the cell)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "\\|")


@dataclass(kw_only=True)
class BenchResult:
    """What a case returns: its tables, the PNGs it wrote (file names in the output
    folder), its raw data (JSON-ready) and warnings about its measurements (repetitions
    that disagree: :func:`pipetrain.bench.harness.noise.measurement_warnings`)."""

    tables: list[Table]
    plots: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


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
