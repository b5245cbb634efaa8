"""The launcher's summary of where a failed job's ranks were: each rank that waited for a
message, the message (kind, micro-batch, the stage and rank that should have sent it) and
for how long, and the ranks that wrote no report (killed, or frozen): from the reports the
workers write into the run folder when a step fails (``hang/rank<R>.json``, see
:mod:`pipetrain.runtime.rank_report`).
"""

from __future__ import annotations

import glob
import os
from typing import Any

__all__ = ["stuck_line"]


def _what(report: dict[str, Any]) -> str:
    wait = report["waits_for"]
    if wait.get("kind") == "collective":
        return f"the other ranks of a collective ({report['action']})"
    return (f"the {wait['kind']} of micro-batch {wait['microbatch']} from stage "
            f"{wait['from_stage']} (rank {wait['from_rank']})")


def stuck_line(out: str, *, since: float, world_size: int) -> str | None:
    """One line on where the ranks of the job that failed in ``out`` were (reports written
    after ``since``, a ``time.time()``), or None when no rank waited for a message.

    Example:
        >>> import json, tempfile
        >>> out = tempfile.mkdtemp()
        >>> os.makedirs(os.path.join(out, "hang"))
        >>> report = {"rank": 0, "step": 7, "action": "1RB3", "seconds": 15.2, "waits_for": {
        ...     "kind": "gradient", "microbatch": 3, "from_stage": 2, "from_rank": 1}}
        >>> _ = open(os.path.join(out, "hang", "rank0.json"), "w").write(json.dumps(report))
        >>> print(stuck_line(out, since=0.0, world_size=2))  # doctest: +ELLIPSIS
        in step 8, rank 0 waited 15 s in 1RB3 for the gradient of micro-batch 3 from stage 2 (rank 1); rank 1 left no report (killed or frozen); details in .../hang
    """
    from pipetrain.cli.run_folder import read_json

    reports: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(out, "hang", "rank*.json")):
        try:
            if os.path.getmtime(path) < since:
                continue  # an earlier job's
            report = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            reports[report["rank"]] = report
    silent = [r for r in range(world_size) if r not in reports]
    if not silent and not any(r.get("waits_for") for r in reports.values()):
        return None  # every rank failed in its own work: its error says what
    parts = [_where(reports[rank]) for rank in sorted(reports)]
    if silent:
        parts.append(f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} left no "
                     "report (killed or frozen)")
    steps = [r["step"] for r in reports.values() if isinstance(r.get("step"), int)]
    where = f"in step {min(steps) + 1}, " if steps else ""
    return where + "; ".join(parts) + f"; details in {os.path.join(out, 'hang')}"


def _where(report: dict[str, Any]) -> str:
    rank = report["rank"]
    if report.get("waits_for"):
        return (f"rank {rank} waited {float(report['seconds'] or 0):.0f} s in {report['action']} "
                f"for {_what(report)}")
    if report.get("action") is None:
        return f"rank {rank} was between steps (in a collective of every rank)"
    return f"rank {rank} was running {report['action']}"
