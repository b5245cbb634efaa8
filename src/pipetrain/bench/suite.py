"""Running benchmark cases in order and writing one result file per case, and a summary.

:func:`run_suite` runs the cases it is given one after another in this process (each
case spawns the processes it measures), says on ``progress`` which case starts and how
it ended (and passes the case's own progress lines on, prefixed with its name), and
writes ``OUT/<name>.json``: the case's tables, plots, data, wall time, CPU time (its own
processes' and those it spawned) and status
(``ok``, ``skipped`` with the reason, ``failed`` with the error), the pictures the case's
``draw`` made from its tables and data after it ran (their file names in ``plots``; a
drawing that fails leaves ``draw_error`` and the status as it was), and the run's metadata
(:func:`pipetrain.bench.run_info.run_metadata`: date, command line, the run's identifier
shared by every case of one ``run_suite`` call, machine with the load average before and
after the case, versions). A case that fails is recorded and the others still run.

Goals and warnings: a case that ran is ``ok`` even when its tables miss their goals
(:class:`~pipetrain.bench.case.Goal`); the record lists every goal (``goals``) and its
``reason`` names the missed ones (``goals missed: ...``), which the progress line and the
command's summary show. ``warnings`` holds the case's own (repetitions that disagree) and
a load average above the core count before or after it
(:mod:`pipetrain.bench.harness.noise`). ``OUT/summary.json`` lists every case's status,
wall time, missed goals and warnings.
"""

from __future__ import annotations

import contextlib
import json
import resource
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Draw, Goal, SkipCase
from pipetrain.bench.drawings import draw_record, merge_plots
from pipetrain.bench.harness.jobs import forked_jobs
from pipetrain.bench.harness.noise import load_warning
from pipetrain.bench.harness.output import dump_json
from pipetrain.bench.registry import check_names, import_failure, load_case, skip_reason
from pipetrain.bench.run_info import load_average, run_metadata

__all__ = ["STATUSES", "missed_goals", "new_run_id", "run_case", "run_suite", "write_json"]

STATUSES = ("ok", "skipped", "failed")
"""A case's outcome in its result file."""


def write_json(path: Path, value: Any) -> None:
    """``value`` as strict JSON (no NaN) in ``path``, written whole or not at all.

    Example::

        write_json(out / "summary.json", {"cases": []})
    """
    partial = path.with_name(path.name + ".partial")
    partial.write_text(dump_json(value) + "\n")
    partial.replace(path)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the processes it spawned and joined (what a
    case costs the machine, whatever else runs on it)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _reason(error: BaseException) -> str:
    """An error in one line: its type and first line (and, after a heading such as a
    failed rank's ``rank 0:``, the line that follows it).

    Example:
        >>> _reason(RuntimeError("rank 0:\\nValueError: bad width\\nTraceback ..."))
        'RuntimeError: rank 0: ValueError: bad width'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(error).__name__}: {text}"[:500]


def _outcome(name: str, context: BenchContext) -> dict[str, Any]:
    """Run case ``name``: its status and, when it ran, its tables, plots and data."""
    try:
        case = load_case(name)
    except ModuleNotFoundError as error:  # an optional package (skipped) or a bug (failed)
        ours = (error.name or "pipetrain").split(".")[0] == "pipetrain"
        return {"title": name, "status": "failed" if ours else "skipped",
                "reason": import_failure(error)}
    reason = skip_reason(case)
    if reason is not None:
        return {"title": case.title, "status": "skipped", "reason": reason}
    try:
        result = case.run(context)
    except SkipCase as skip:
        return {"title": case.title, "status": "skipped", "reason": str(skip)}
    except Exception as error:  # recorded; the other cases still run
        return {"title": case.title, "status": "failed", "reason": _reason(error),
                "error": traceback.format_exc()}
    if not isinstance(result, BenchResult):
        return {"title": case.title, "status": "failed",
                "reason": f"run() returned {type(result).__name__}, not a BenchResult"}
    goals = [g for t in result.tables for g in t.goals]
    missed = [g for t in result.tables for g in t.missed()]
    return {"title": case.title, "status": "ok", "reason": missed_goals(missed),
            "tables": [t.to_dict() for t in result.tables], "plots": list(result.plots),
            "data": result.data, "goals": [g.to_dict() for g in goals],
            "warnings": list(result.warnings)}


def missed_goals(missed: list[Goal]) -> str | None:
    """The reason line of a case that ran but missed goals (``None``: none missed).

    Example:
        >>> missed_goals([Goal.at_least("plan / even split", 0.53, 1.3, unit="x")])
        'goals missed: plan / even split 0.53x (goal >= 1.30x)'
    """
    if not missed:
        return None
    return "goals missed: " + "; ".join(f"{g.name} {g.value} (goal {g.target})" for g in missed)


def new_run_id() -> str:
    """A new run's identifier: its start time and a random suffix (what ties the result
    files of one ``pipetrain bench`` run together).

    Example:
        >>> len(new_run_id().split("-")[-1])
        8
    """
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def _drawn(draw: Draw, outcome: dict[str, Any], context: BenchContext) -> dict[str, Any]:
    """Draw a run's pictures from its tables and data as the result file will hold them
    (one JSON round trip, as :mod:`pipetrain.bench.redraw` reads them), after its wall
    and CPU time are taken: the record's ``plots`` with them, or the drawing's error (the
    run's figures are kept)."""
    recorded = json.loads(dump_json({"tables": outcome["tables"], "data": outcome["data"]}))
    try:
        drawn = draw_record(draw, recorded, context.out)
    except Exception as error:  # a picture lost, not the measurements
        context.progress(f"drawing failed: {_reason(error)}")
        return {"draw_error": _reason(error)}
    return {"plots": merge_plots(outcome["plots"], drawn)}


def run_case(name: str, *, quick: bool, out: Path, command: str,
             progress: Callable[[str], None], run_id: str | None = None) -> dict[str, Any]:
    """Run one case and write ``out/<name>.json``; the record written. ``run_id``: the
    run it belongs to (default: a run of its own).

    Example::

        record = run_case("transport", quick=True, out=Path("results"),
                          command="pipetrain bench transport --quick", progress=log)
    """
    metadata = {**run_metadata(command), "run_id": run_id or new_run_id()}
    context = BenchContext(quick=quick, out=out, progress=lambda line: progress(f"  {name}: {line}"))
    began, cpu = time.perf_counter(), _cpu_seconds()
    # a quick run checks that the case works: its jobs' ranks are forked, not spawned
    with forked_jobs() if quick else contextlib.nullcontext():
        outcome = _outcome(name, context)
    wall = time.perf_counter() - began
    metadata["machine"]["load_average_after"] = load_average()
    record: dict[str, Any] = {"name": name, "quick": quick, "wall_s": round(wall, 3),
                              "cpu_s": round(_cpu_seconds() - cpu, 3),
                              "tables": [], "plots": [], "data": {}, "goals": [],
                              "warnings": [], **outcome, "metadata": metadata}
    machine = metadata["machine"]
    for when in ("before", "after"):
        busy = load_warning(machine.get(f"load_average_{when}"), cores=machine.get("usable_cores"))
        if busy is not None:
            record["warnings"].append(f"{when} the case: {busy}")
    draw = load_case(name).draw if record["status"] == "ok" else None
    if draw is not None:
        record.update(_drawn(draw, record, context))
    write_json(out / f"{name}.json", record)
    return record


def run_suite(names: Sequence[str], *, quick: bool, out: Path, command: str,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the cases ``names`` in order into ``out``; the summary (also written to
    ``out/summary.json``).

    Raises:
        ValueError: a name is not a case (the message lists the cases).

    Example::

        summary = run_suite(["transport", "planner_speed"], quick=True,
                            out=Path("bench-results/now"), command="...", progress=log)
        failed = [c["name"] for c in summary["cases"] if c["status"] == "failed"]
    """
    check_names(names)
    out.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    summary: dict[str, Any] = {**run_metadata(command), "run_id": run_id, "quick": quick,
                               "out": str(out), "cases": []}
    began = time.perf_counter()
    for k, name in enumerate(names, 1):
        progress(f"[{k}/{len(names)}] {name}: started")
        record = run_case(name, quick=quick, out=out, command=command, progress=progress,
                          run_id=run_id)
        ending = f"{record['status']} in {record['wall_s']:.1f} s"
        if record["reason"]:
            ending += f" ({record['reason']})"
        progress(f"[{k}/{len(names)}] {name}: {ending}")
        for warning in record["warnings"]:
            progress(f"[{k}/{len(names)}] {name}: warning: {warning}")
        missed = [g["name"] for g in record["goals"] if g["met"] is False]
        summary["cases"].append({"name": name, "title": record["title"],
                                 "status": record["status"], "reason": record["reason"],
                                 "wall_s": record["wall_s"], "cpu_s": record["cpu_s"],
                                 "goals_missed": missed, "warnings": record["warnings"]})
        write_json(out / "summary.json", summary)
    summary["wall_s"] = round(time.perf_counter() - began, 3)
    summary["machine"]["load_average_after"] = load_average()
    write_json(out / "summary.json", summary)
    return summary
