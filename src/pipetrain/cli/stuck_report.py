"""The launcher's summary of where a job's ranks were: each rank that waited for a message,
the message (kind, micro-batch, the stage and rank that should have sent it) and for how
long, and the ranks that wrote no report (killed, or frozen): from the reports the workers
write into the run folder (``hang/rank<R>.json``, see :mod:`pipetrain.runtime.rank_report`)
when a step fails, or when the launcher asks them (SIGUSR1 to ``pipetrain train``: the
launcher touches ``hang/request``, which each worker watches from a thread of its own, so a
rank blocked in a collective answers too).
"""

from __future__ import annotations

import glob
import os
from typing import Any

__all__ = ["REQUEST", "ask_ranks", "stuck_line", "watch_requests"]

REQUEST = "request"
"""The file in ``RUN/hang/`` whose new modification time asks every worker for its report."""


def _what(report: dict[str, Any]) -> str:
    wait = report["waits_for"]
    if wait.get("kind") == "collective":
        return f"the other ranks of a collective ({report['action']})"
    return (f"the {wait['kind']} of micro-batch {wait['microbatch']} from stage "
            f"{wait['from_stage']} (rank {wait['from_rank']})")


def stuck_line(out: str, *, since: float, world_size: int, always: bool = False) -> str | None:
    """One line on where the ranks of the job in ``out`` were (reports written after
    ``since``, a ``time.time()``), or None when no rank waited for a message and none is
    silent (``always``: the line all the same, as asked for with SIGUSR1).

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
    if not always and not silent and not any(r.get("waits_for") for r in reports.values()):
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
        return f"rank {rank} was between steps (in the run's own work or a collective of every rank)"
    return f"rank {rank} was running {report['action']}"


def ask_ranks(out: str, *, world_size: int, wait: float = 3.0,
              say: Any = None) -> None:
    """Ask every worker of the job in ``out`` where it is, and after ``wait`` seconds say
    (``say``: a function of one line; default: this process's stderr) what they answered
    (from the launcher, on SIGUSR1; returns at once, the answer comes from a thread).

    Example::

        signal.signal(signal.SIGUSR1, lambda *_: ask_ranks("runs/a", world_size=2))
    """
    import sys
    import threading
    import time

    asked = time.time()
    folder = os.path.join(out, "hang")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, REQUEST), "w") as file:
        file.write(f"{asked}\n")

    def answer() -> None:
        time.sleep(wait)
        line = stuck_line(out, since=asked, world_size=world_size, always=True)
        text = f"pipetrain train: where the ranks are: {line}\n"
        if say is not None:
            say(text)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    threading.Thread(target=answer, name="pipetrain-ask-ranks", daemon=True).start()


def watch_requests(out: str, write: Any, *, poll: float = 0.5) -> Any:
    """Call ``write()`` (a worker's report) each time ``RUN/hang/request`` is touched anew,
    from a daemon thread of its own; returns the ``threading.Event`` that stops it.

    Example::

        stop = watch_requests(run_folder, lambda: write_report())
    """
    import threading

    path = os.path.join(out, "hang", REQUEST)
    stop = threading.Event()

    def seen() -> float:
        try:
            return os.path.getmtime(path)
        except OSError:
            return 0.0

    def watch() -> None:
        last = seen()
        while not stop.wait(poll):
            now = seen()
            if now > last:
                last = now
                write()

    threading.Thread(target=watch, name="pipetrain-report-on-request", daemon=True).start()
    return stop
