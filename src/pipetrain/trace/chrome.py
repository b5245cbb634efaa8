"""The Chrome trace: recorded steps as trace-event JSON for Perfetto or chrome://tracing.

Layout: one process per rank (``pid`` = rank, named ``rank r``), one thread per stage
it holds (``tid`` = stage, named ``stage j``), one complete event (``ph: "X"``) per
action, named in the compact form (``1F3``) with a category per kind of op (see
:data:`CATEGORIES`) and ``args`` ``step``, ``stage``, ``microbatch``, ``op``. One extra
process on top, ``steps``, holds a slice per step carrying its measured makespan and
bubble. Times are microseconds from the earliest recorded start.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pipetrain.schedule import Action, Op, TimedAction
from pipetrain.trace.measure import measure_step
from pipetrain.trace.recorded import check_timeline

__all__ = ["CATEGORIES", "chrome_trace", "write_chrome_trace"]

CATEGORIES = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward_input",
    Op.BACKWARD_WEIGHT: "backward_weight",
    Op.SEND_FORWARD: "send",
    Op.SEND_BACKWARD: "send",
    Op.RECV_FORWARD: "receive",
    Op.RECV_BACKWARD: "receive",
    Op.REDUCE_GRAD: "reduce",
    Op.UNSHARD: "gather",
    Op.RESHARD: "gather",
    Op.OPTIMIZER_STEP: "optimizer",
}
"""Trace-event category (``cat``) of each op; steps have the category ``step``."""

_MICROSECONDS = 1e6
_GATHERS = (Op.UNSHARD, Op.RESHARD)
_GATHER_TRACKS = 10_000  # thread id of stage j's gathers: 10000 + j


def chrome_trace(
    steps: Sequence[Sequence[TimedAction]],
    *,
    step_offsets: Sequence[float] | None = None,
    rank_names: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    step_numbers: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Recorded steps (each: every rank's actions, seconds, one axis) as a Chrome trace.

    Without ``step_offsets`` the steps are laid end to end, each starting where the one
    before ended (each step's times are relative to its own origin). With them, step
    ``k``'s times are shifted by ``step_offsets[k]`` seconds (e.g. its origin's
    ``time.time()``, to show the real gaps between steps). ``rank_names`` names the
    rank processes (default ``rank r``, e.g. pass host names); ``metadata`` (JSON-ready)
    is stored as the trace's ``otherData``. ``step_numbers`` numbers the steps in the
    events (default ``0, 1, ...``; a training run passes its own, 1-based, step numbers).

    Example:
        >>> from pipetrain.schedule import build_schedule, simulate
        >>> step = simulate(build_schedule("gpipe", num_ranks=2, num_microbatches=2)).timeline
        >>> trace = chrome_trace([step, step])
        >>> forward = next(e for e in trace["traceEvents"] if e["name"] == "1F0")
        >>> forward["ph"], forward["pid"], forward["tid"], forward["cat"], forward["args"]
        ('X', 1, 1, 'forward', {'step': 0, 'stage': 1, 'op': 'F', 'microbatch': 0})
        >>> [e["ts"] for e in trace["traceEvents"] if e.get("cat") == "step"]
        [0.0, 9000000.0]

    Raises:
        TypeError: ``steps`` is a single step (a sequence of
            :class:`~pipetrain.schedule.TimedAction`) instead of a sequence of steps.
        ValueError: an invalid action, ``step_offsets`` not one per step, or too few
            ``rank_names``.
    """
    if steps and isinstance(steps[0], TimedAction):
        raise TypeError(
            "chrome_trace() takes a sequence of steps, each a sequence of TimedAction; "
            "got a single step: wrap it, chrome_trace([timeline])"
        )
    checked = [check_timeline(step) for step in steps]
    num_ranks = max((t.rank + 1 for step in checked for t in step), default=0)
    problems = []
    if step_offsets is not None and len(step_offsets) != len(checked):
        problems.append(
            f"step_offsets has {len(step_offsets)} values for {len(checked)} steps; "
            f"give one offset (seconds) per step"
        )
    if rank_names is not None and len(rank_names) < num_ranks:
        problems.append(
            f"rank_names has {len(rank_names)} names but the steps have {num_ranks} ranks; "
            f"give one name per rank"
        )
    if problems:
        raise ValueError("cannot build the Chrome trace: " + "; ".join(problems))

    offsets = _place(checked) if step_offsets is None else [float(o) for o in step_offsets]
    # relative to the earliest offset first: wall-clock offsets (~1.7e9 s) added to
    # small times would lose their microseconds
    earliest = min(offsets, default=0.0)
    offsets = [o - earliest for o in offsets]
    starts = [min(t.start for t in step) + o for step, o in zip(checked, offsets) if step]
    base = min(starts, default=0.0)

    def micros(seconds: float) -> float:
        return round((seconds - base) * _MICROSECONDS, 3)

    numbers = list(range(len(checked))) if step_numbers is None else [int(n) for n in step_numbers]
    if len(numbers) != len(checked):
        raise ValueError(f"step_numbers has {len(numbers)} entries for {len(checked)} steps")
    steps_pid = num_ranks
    events: list[dict[str, Any]] = []
    for k, step, offset in zip(numbers, checked, offsets):
        if not step:
            continue
        for t in step:
            ts = micros(t.start + offset)
            args: dict[str, Any] = {"step": k, "stage": t.action.stage, "op": t.action.op.value}
            if t.action.microbatch is not None:
                args["microbatch"] = t.action.microbatch
            if t.action.version is not None:
                args["version"] = t.action.version
            events.append(
                {
                    "name": str(t.action),
                    "cat": CATEGORIES[t.action.op],
                    "ph": "X",
                    "ts": ts,
                    "dur": round(micros(t.end + offset) - ts, 3),
                    "pid": t.rank,
                    "tid": _track(t.action),
                    "args": args,
                }
            )
        measure = measure_step(step, num_ranks=num_ranks)
        first = min(t.start for t in step) + offset
        ts = micros(first)
        events.append(
            {
                "name": f"step {k}",
                "cat": "step",
                "ph": "X",
                "ts": ts,
                "dur": round(micros(first + measure.makespan) - ts, 3),
                "pid": steps_pid,
                "tid": 0,
                "args": {
                    "step": k,
                    "makespan_ms": measure.makespan * 1e3,
                    "bubble_fraction": measure.bubble_fraction,
                },
            }
        )
    # stable: a send (no duration) keeps its place before the action starting with it
    events.sort(key=lambda e: e["ts"])
    trace: dict[str, Any] = {
        "traceEvents": _names(checked, num_ranks, rank_names) + events,
        "displayTimeUnit": "ms",
    }
    if metadata is not None:
        trace["otherData"] = dict(metadata)
    return trace


def write_chrome_trace(
    steps: Sequence[Sequence[TimedAction]],
    path: str | os.PathLike[str],
    *,
    step_offsets: Sequence[float] | None = None,
    rank_names: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    step_numbers: Sequence[int] | None = None,
) -> None:
    """Write :func:`chrome_trace` as JSON to ``path`` (gzip-compressed if it ends in ``.gz``).

    Open the file at https://ui.perfetto.dev or in chrome://tracing.

    Example:
        >>> import json, tempfile, pathlib
        >>> from pipetrain.schedule import build_schedule, simulate
        >>> step = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=2)).timeline
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "trace.json"
        >>> write_chrome_trace([step], path, metadata={"schedule": "1f1b"})
        >>> json.loads(path.read_text())["otherData"]
        {'schedule': '1f1b'}

    Raises:
        TypeError, ValueError: as :func:`chrome_trace`.
    """
    trace = chrome_trace(steps, step_offsets=step_offsets, rank_names=rank_names, metadata=metadata,
                         step_numbers=step_numbers)
    text = json.dumps(trace, separators=(",", ":"))
    if os.fspath(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as file:
            file.write(text)
    else:
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)


def _place(steps: Sequence[Sequence[TimedAction]]) -> list[float]:
    """Offsets that lay the steps end to end, the first one where it was recorded."""
    offsets, end = [], None
    for step in steps:
        if not step:
            offsets.append(0.0 if end is None else end)
            continue
        offset = 0.0 if end is None else end - min(t.start for t in step)
        offsets.append(offset)
        end = max(t.end for t in step) + offset
    return offsets


def _names(
    steps: Sequence[Sequence[TimedAction]], num_ranks: int, rank_names: Sequence[str] | None
) -> list[dict[str, Any]]:
    """The metadata events naming and ordering the processes (ranks) and threads (stages)."""
    stages: dict[int, set[int]] = {r: set() for r in range(num_ranks)}
    gathers: dict[int, set[int]] = {r: set() for r in range(num_ranks)}
    for step in steps:
        for t in step:
            (gathers if t.action.op in _GATHERS else stages)[t.rank].add(t.action.stage)
    events: list[dict[str, Any]] = []

    def name(pid: int, tid: int, what: str, args: dict[str, Any]) -> None:
        events.append({"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args})

    name(num_ranks, 0, "process_name", {"name": "steps"})
    name(num_ranks, 0, "process_sort_index", {"sort_index": -1})
    name(num_ranks, 0, "thread_name", {"name": "step"})
    for r in range(num_ranks):
        first = min(stages[r], default=0)
        name(r, first, "process_name", {"name": rank_names[r] if rank_names else f"rank {r}"})
        name(r, first, "process_sort_index", {"sort_index": r})
        for j in sorted(stages[r]):
            name(r, j, "thread_name", {"name": f"stage {j}"})
            name(r, j, "thread_sort_index", {"sort_index": j})
        for j in sorted(gathers[r]):
            name(r, _GATHER_TRACKS + j, "thread_name", {"name": f"stage {j} FSDP gathers"})
            name(r, _GATHER_TRACKS + j, "thread_sort_index", {"sort_index": _GATHER_TRACKS + j})
    return events


def _track(action: Action) -> int:
    """The thread an action is drawn on: its stage's, or (FSDP's gathers, which run in the
    background beside the stage's work) a track of the stage's gathers."""
    return _GATHER_TRACKS + action.stage if action.op in _GATHERS else action.stage
