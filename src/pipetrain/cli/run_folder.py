"""A run folder of ``pipetrain train``: is it free for a new run, which run does a
``--resume`` point at, and writing the run's records so that no crash corrupts them.

A run folder holds ``config.json`` (the options of its latest session), ``metrics.json``
(the whole run's history, see ``docs/run-folder.md``), ``steps.jsonl`` (its steps, one
line each), ``checkpoint/``, ``timeline.png``, ``trace.json`` and ``sample.txt``. JSON
files are written to a temporary name and renamed, so a reader sees the old file or the
new one, never half; they are strict JSON (a number that is not finite is ``null``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ResumeSource",
    "contents",
    "json_safe",
    "new_run_problem",
    "read_json",
    "resume_source",
    "same_folder",
    "write_json",
]


def contents(path: str) -> list[str]:
    """The entries of folder ``path`` (sorted; empty when it is missing or empty), its
    lock file (:mod:`.run_lock`) left out."""
    try:
        return sorted(name for name in os.listdir(path) if name != ".lock")  # a run's lock file
    except (FileNotFoundError, NotADirectoryError):
        return []


def same_folder(a: str, b: str) -> bool:
    """Whether two paths name the same folder.

    Example:
        >>> same_folder("runs/a", "runs/./a/")
        True
    """
    return os.path.realpath(a) == os.path.realpath(b)


def new_run_problem(out: str, *, resume: str | None) -> str | None:
    """Why ``out`` cannot take this run, or None: a new run needs a new or empty folder;
    only ``--resume`` of that same folder may write into an existing run.

    Example:
        >>> new_run_problem("/nonexistent/run", resume=None) is None
        True
    """
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out!r} is a file, not a folder; fix: --out a new folder name"
    found = contents(out)
    if not found:
        return None
    if resume is not None and same_folder(out, resume_source(resume).run_folder or resume):
        return None
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    return (
        f"--out {out!r} already holds a run ({shown}); a new run would overwrite it. Fix: "
        f"--resume {out} to continue that run, or a new --out folder"
    )


@dataclass(frozen=True)
class ResumeSource:
    """What ``--resume DIR`` points at."""

    checkpoint: str
    """The checkpoint folder (``DIR/checkpoint`` for a run folder)."""
    run_folder: str | None
    """The run folder whose options and history the resume continues (None: a bare
    checkpoint folder outside a run folder)."""


def resume_source(path: str) -> ResumeSource:
    """Resolve ``--resume``: a run folder (with ``config.json`` or ``checkpoint/``) or a
    checkpoint folder (inside a run folder, or on its own).

    Example:
        >>> resume_source("/nonexistent/run/checkpoint").checkpoint
        '/nonexistent/run/checkpoint'
    """
    path = os.path.normpath(path)
    marks = ("config.json", "metrics.json", "checkpoint", "checkpoint.previous", "checkpoint.partial")
    if any(os.path.exists(os.path.join(path, mark)) for mark in marks):
        return ResumeSource(os.path.join(path, "checkpoint"), path)
    parent = os.path.dirname(path)
    if os.path.isfile(os.path.join(parent, "config.json")):
        return ResumeSource(path, parent)
    return ResumeSource(path, None)


def read_json(path: str) -> Any:
    """The JSON value in ``path``, or None when there is no such file.

    Raises:
        ValueError: the file is not valid JSON (the message names it).
    """
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path!r} is not valid JSON ({error}); it was not written by "
                         "pipetrain train, or was edited") from None


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, infinities) replaced by ``None``
    (``null``: strict JSON parsers refuse ``NaN``), in dicts, lists and tuples.

    Example:
        >>> json_safe({"loss": float("nan"), "norms": [1.5, float("inf")]})
        {'loss': None, 'norms': [1.5, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _dumps(value: Any, *, indent: int | None) -> str:
    return json.dumps(json_safe(value), indent=indent, default=str, allow_nan=False)


def write_json(path: str, value: Any, *, rows: tuple[str, Iterable[Any]] | None = None) -> None:
    """Write ``value`` as strict JSON to ``path`` atomically (temporary file, fsync, rename).

    ``rows`` (``key``, items): ``value[key]`` is written as the list of ``items``, one per
    line, taken as they come (a long list is never held in memory); ``value`` is then a
    dict and holds ``key`` where the list goes.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "m.json")
        >>> write_json(path, {"a": 1, "steps": None, "b": float("nan")},
        ...            rows=("steps", iter([{"step": 1}, {"step": 2}])))
        >>> read_json(path)
        {'a': 1, 'steps': [{'step': 1}, {'step': 2}], 'b': None}
    """
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as file:
        if rows is None:
            file.write(_dumps(value, indent=2))
        else:
            key, items = rows
            fields = [f"  {json.dumps(name)}: "
                      + ("[" if name == key else _dumps(item, indent=2).replace("\n", "\n  "))
                      for name, item in value.items()]
            file.write("{\n")
            for number, (name, field) in enumerate(zip(value, fields)):
                file.write(field)
                if name == key:
                    for count, item in enumerate(items):
                        file.write(("\n    " if count == 0 else ",\n    ") + _dumps(item, indent=None))
                    file.write("\n  ]")
                file.write(",\n" if number < len(fields) - 1 else "\n")
            file.write("}")
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
