"""Reading a case's figures out of its recorded tables, for the pictures its ``draw`` makes.

Tables hold figures as numbers or as formatted text (``"1.23x"``, ``"39.7 ms"``,
``"-18.7%"``, ``"0.434 MB"``, ``"282.2M"``); :func:`number` reads either, and a cell that
holds no figure (``"-"``, ``"not run"``, ``None``) as ``None`` (no bar, a gap in a line).
:func:`series` gathers columns into the categories and series that
:func:`~pipetrain.bench.plots.bar_chart` and :func:`~pipetrain.bench.plots.line_chart` take,
and :func:`draw_record` runs a case's ``draw`` on a result file's record (the suite and
:mod:`pipetrain.bench.redraw` both draw through it, so a picture drawn again equals the one
drawn after the run).

Example:
    >>> table = Table(title="t", columns=["schedule", "ratio", "bound"],
    ...               rows=[["gpipe", "1.24x", "1.29x"], ["1f1b", "-", 1.2]])
    >>> series(table, "schedule", {"measured": "ratio", "bound": "bound"})
    (['gpipe', '1f1b'], {'measured': [1.24, None], 'bound': [1.29, 1.2]})
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipetrain.bench.case import Draw, Table
from pipetrain.bench.plots import bar_chart

__all__ = ["Column", "bars", "column", "draw_record", "find_table", "merge_plots", "number",
           "numbers", "quotient", "series", "texts"]

_FIGURE = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z%]*)$")
_SCALE = {"": 1.0, "x": 1.0, "%": 1.0, "us": 1.0, "ms": 1.0, "s": 1.0, "KiB": 1.0,
          "MiB": 1.0, "GiB": 1.0, "KB": 1.0, "MB": 1.0, "GB": 1.0, "K": 1e3, "M": 1e6,
          "B": 1e9}
"""The units a figure may carry: kept as written (``"39.7 ms"`` -> 39.7, ``"84.2%"`` ->
84.2), except the count suffixes (``"1.3B"`` -> 1.3e9)."""


def number(cell: Any) -> float | None:
    """The figure a table cell holds, or ``None`` when it holds none.

    A number is itself; text is a number with an optional unit (``x``, ``%``, ``ms``,
    ``s``, ``us``, ``MiB``, ``MB``...: the number as written) or count suffix (``K``,
    ``M``, ``B``: scaled). Anything else (``"-"``, ``"not run"``, ``"67.1 / 135.4 ms"``,
    booleans, NaN) is ``None``.

    Example:
        >>> [number(c) for c in ["1.23x", " 39.7 ms", "-18.7%", "+7.7%", "282.2M", 3, "-"]]
        [1.23, 39.7, -18.7, 7.7, 282200000.0, 3.0, None]
    """
    if cell is None or isinstance(cell, bool):
        return None
    if isinstance(cell, (int, float)):
        value = float(cell)
        return value if math.isfinite(value) else None
    if not isinstance(cell, str):
        return None
    match = _FIGURE.match(cell.strip())
    if match is None or match.group(2) not in _SCALE:
        return None
    value = float(match.group(1)) * _SCALE[match.group(2)]
    return value if math.isfinite(value) else None


def column(table: Table, name: str) -> list[Any]:
    """The cells of column ``name``, one per row.

    Raises:
        ValueError: the table has no such column (the message lists its columns).

    Example:
        >>> column(Table(title="t", columns=["a", "b"], rows=[[1, 2], [3, 4]]), "b")
        [2, 4]
    """
    if name not in table.columns:
        raise ValueError(f"table {table.title!r} has no column {name!r}; its columns are "
                         f"{table.columns}")
    index = table.columns.index(name)
    return [row[index] if index < len(row) else None for row in table.rows]


def numbers(table: Table, name: str) -> list[float | None]:
    """The figures of column ``name`` (:func:`number` of each cell).

    Example:
        >>> numbers(Table(title="t", columns=["ratio"], rows=[["1.5x"], ["-"]]), "ratio")
        [1.5, None]
    """
    return [number(cell) for cell in column(table, name)]


def texts(table: Table, name: str) -> list[str]:
    """The cells of column ``name`` as text (labels of categories; ``None`` as ``""``).

    Example:
        >>> texts(Table(title="t", columns=["K"], rows=[[2], [None]]), "K")
        ['2', '']
    """
    return ["" if cell is None else str(cell) for cell in column(table, name)]


def find_table(tables: Sequence[Table], key: str) -> Table | None:
    """The table whose :attr:`~pipetrain.bench.case.Table.key` is ``key``, else the first
    whose title starts with ``key``; ``None`` when none does (a quick run may leave a
    table out).

    Example:
        >>> find_table([Table(title="Bytes sent per sample", columns=[], rows=[])],
        ...            "Bytes sent").title
        'Bytes sent per sample'
    """
    for table in tables:
        if table.key and table.key == key:
            return table
    return next((table for table in tables if table.title.startswith(key)), None)


Column = str | Sequence[float | None]
"""A series' source: a column's name, or figures already read (one per row)."""


def series(table: Table, label: str | Sequence[str], columns: Mapping[str, Column], *,
           where: Mapping[str, Any] | None = None, form: str | None = None,
           ) -> tuple[list[str], dict[str, list[float | None]]]:
    """Categories (column ``label``'s text; several columns joined by ``", "``, or put
    into ``form``'s ``{}`` in turn) and one series per ``columns`` entry (series name ->
    column name, or one figure per row) from ``table``'s rows.

    Rows without a figure in any of the columns are left out, as are rows whose text in
    a column of ``where`` is not the one given, or not one of those given
    (``where={"model": "GPT"}``, ``where={"layout": ("plan", "even")}``).

    Raises:
        ValueError: a column is not in the table.

    Example:
        >>> table = Table(title="t", columns=["K", "M", "ours"],
        ...               rows=[[2, 4, "1.1x"], [4, 4, "-"], ["paper", "", "n/a"]])
        >>> series(table, ["K", "M"], {"pipetrain": "ours"})
        (['2, 4'], {'pipetrain': [1.1]})
        >>> series(table, ["K", "M"], {"pipetrain": "ours"}, form="K={}, M={}")[0]
        ['K=2, M=4']
    """
    labels = [label] if isinstance(label, str) else list(label)
    names = [texts(table, name) for name in labels]
    values = {name: numbers(table, source) if isinstance(source, str) else list(source)
              for name, source in columns.items()}
    for name, figures in values.items():
        if len(figures) != len(table.rows):
            raise ValueError(f"series {name!r} has {len(figures)} figures for the "
                             f"{len(table.rows)} rows of table {table.title!r}")
    wanted = [(texts(table, name), _accepted(value)) for name, value in (where or {}).items()]
    chosen = [i for i in range(len(table.rows))
              if any(v[i] is not None for v in values.values())
              and all(cells[i] in accepted for cells, accepted in wanted)]
    parts = [[cells[i] for cells in names] for i in chosen]
    categories = [", ".join(p) if form is None else form.format(*p) for p in parts]
    return categories, {name: [v[i] for i in chosen] for name, v in values.items()}


def _accepted(value: Any) -> set[str]:
    """The texts a ``where`` entry accepts: one value, or each of a list, tuple or set."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return {str(v) for v in value}
    return {str(value)}


def quotient(numerators: Sequence[float | None],
             denominators: Sequence[float | None]) -> list[float | None]:
    """Each numerator over its denominator (``None`` where either is missing or the
    denominator is 0).

    Example:
        >>> quotient([3.0, None, 1.0], [2.0, 1.0, 0.0])
        [1.5, None, None]
    """
    return [a / b if a is not None and b else None for a, b in zip(numerators, denominators)]


def bars(path: Path, table: Table | None, label: str | Sequence[str],
         columns: Mapping[str, Column], *, title: str, ylabel: str,
         where: Mapping[str, Any] | None = None, form: str | None = None,
         **options: Any) -> list[str]:
    """A grouped bar chart of ``table``'s rows (:func:`series` of ``label``, ``columns``,
    ``where`` and ``form``) into ``path``: its file name in a list, or an empty list when there is
    nothing to draw (no table, no row with a figure). ``options`` go to
    :func:`~pipetrain.bench.plots.bar_chart` (``reference``, ``log``...).

    Example:
        >>> import tempfile
        >>> table = Table(title="t", columns=["size", "ratio"], rows=[["32 KiB", "2.9x"]])
        >>> folder = Path(tempfile.mkdtemp())
        >>> bars(folder / "t.png", table, "size", {"ratio": "ratio"}, title="t", ylabel="x")
        ['t.png']
        >>> bars(folder / "u.png", None, "size", {"ratio": "ratio"}, title="t", ylabel="x")
        []
    """
    if table is None:
        return []
    categories, values = series(table, label, columns, where=where, form=form)
    if not categories:
        return []
    return [bar_chart(path, title=title, categories=categories, series=values,
                      ylabel=ylabel, **options)]


def draw_record(draw: Draw, record: Mapping[str, Any], out: Path) -> list[str]:
    """Run a case's ``draw`` on a result file's ``record`` (its ``tables`` as dicts, its
    ``data``) into folder ``out``; the PNG file names it wrote.

    Example::

        names = draw_record(load_case("transport").draw, record, Path("bench-results/full"))
    """
    tables = [Table.from_dict(table) for table in record.get("tables") or []]
    return list(draw(tables, dict(record.get("data") or {}), out))


def merge_plots(own: Sequence[str], drawn: Sequence[str]) -> list[str]:
    """The pictures a run returned itself followed by those its ``draw`` made, each once.

    Example:
        >>> merge_plots(["a.png", "b.png"], ["b.png", "c.png"])
        ['a.png', 'b.png', 'c.png']
    """
    return list(dict.fromkeys([*own, *drawn]))
