"""A run folder of ``pipetrain train``: is it free for a new run, which run does a
``--resume`` point at, and writing the run's records so that no crash corrupts them.

A run folder holds ``config.json`` (the options of its latest session), ``metrics.json``
(the whole run's history, see ``docs/run-folder.md``), ``checkpoint/``,
``timeline.png``, ``trace.json`` and ``sample.txt``. JSON files are written to a
temporary name and renamed, so a reader sees the old file or the new one, never half.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ResumeSource",
    "contents",
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


def write_json(path: str, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (temporary file, then rename)."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2, default=str)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
