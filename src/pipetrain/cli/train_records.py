"""The records of a training run (rank 0): ``metrics.json``, ``timeline.png``, ``trace.json``.

``metrics.json`` holds the whole run: a resumed run carries the history of the run it
continues (the steps up to its checkpoint) and adds a *segment* per session, with the
options of that session and the ones it changed. The file is rewritten whenever a
checkpoint is saved and when the run ends, stops or fails, so the records never fall
behind the checkpoint. Its fields are documented in ``docs/run-folder.md``.

During training the file is also rewritten every few seconds (:meth:`RunRecords.write_if_due`),
and a worker that is about to be ended writes it from another thread (:meth:`RunRecords.stop`):
a run that dies keeps its history up to its last step.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from pipetrain.cli.run_folder import read_json, write_json
from pipetrain.cli.run_logs import TensorBoardLog, render_loss
from pipetrain.schedule import Schedule, TimedAction, simulate
from pipetrain.trace import StepMeasure, measure_step, render_measured_timeline, write_chrome_trace

__all__ = ["METRICS_SCHEMA", "RunRecords"]

logger = logging.getLogger(__name__)

METRICS_SCHEMA = 2
"""Version of the ``metrics.json`` layout (``docs/run-folder.md``)."""
_TRACE_STEPS = 3
"""How many final steps go into trace.json."""
WRITE_EVERY = 2.0
"""Seconds between the rewrites of ``metrics.json`` during training."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class RunRecords:
    """What rank 0 records about a run, and the files it writes.

    ``history`` is the folder whose ``metrics.json`` this run continues (None for a new
    run); its steps after ``first_step - 1`` (past the checkpoint) are dropped.

    Example::

        records = RunRecords("runs/a", options, world_size=2, first_step=1)
        records.add({"step": 1, "loss": 5.5, ...}, measure, timeline)
        records.write(schedule=...)
    """

    def __init__(self, out: str, options: dict[str, Any], *, world_size: int, first_step: int,
                 history: str | None = None, changes: dict[str, tuple[Any, Any]] | None = None,
                 checkpoint_step: int | None = None) -> None:
        self.out = out
        self.options = options
        self.world_size = world_size
        self.steps: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        if history is not None:
            earlier = read_json(os.path.join(history, "metrics.json")) or {}
            self.steps = [s for s in earlier.get("steps", []) if s.get("step", 0) < first_step]
            self.segments = [dict(g) for g in earlier.get("segments", []) if g.get("first_step", 0) < first_step]
        self.segments.append({
            "first_step": first_step,
            "args": options,
            "changed": {name: list(pair) for name, pair in (changes or {}).items()},
        })
        self.measures: list[StepMeasure] = []
        self.traced: list[tuple[int, list[TimedAction]]] = []
        self.checkpoint_step = checkpoint_step
        """The step of the run's newest checkpoint (None before the first save)."""
        self.stopped: dict[str, Any] | None = None
        self.memory: list[Any] | None = None
        self.sample: str | None = None
        self.schedule: Callable[[], Schedule] | None = None
        """The schedule of a step (for the simulator's makespan in the summary)."""
        self.sources: dict[str, str] = {}
        """Where each option came from (``default``, ``command line``, ``plan``...)."""
        self.command_line: list[str] = []
        """The command line as typed."""
        self._lock = threading.RLock()
        self._written = time.monotonic()
        self.tensorboard = TensorBoardLog(out)
        """TensorBoard events of the run, in the run folder (see :mod:`.run_logs`)."""

    # -- recording ----------------------------------------------------------------------
    def add(self, record: dict[str, Any], measure: StepMeasure, timeline: list[TimedAction]) -> None:
        """Record one step (its ``record``, the measure and timeline of its actions)."""
        with self._lock:
            self.steps.append(record)
            self.measures.append(measure)
            self.traced = [*self.traced, (int(record["step"]), timeline)][-_TRACE_STEPS:]

    def logged(self, record: dict[str, Any]) -> None:
        """Write a step's record to TensorBoard (once it is complete: validation loss
        included), and ``metrics.json`` if due."""
        self.tensorboard.step(record)
        self.write_if_due()

    def close(self) -> None:
        """Close the TensorBoard events (the run ends)."""
        self.tensorboard.close()

    def write_if_due(self) -> None:
        """Rewrite ``metrics.json`` if the last write is :data:`WRITE_EVERY` seconds old."""
        if time.monotonic() - self._written >= WRITE_EVERY:
            self.write()

    def stop(self, stopped: dict[str, Any]) -> None:
        """Record how the run ended and write the records (safe from another thread, e.g.
        just before the worker is ended; an earlier ``stopped`` is kept)."""
        with self._lock:
            if self.stopped is None:
                self.stopped = stopped
            self.write()
            self.tensorboard.flush()

    @property
    def session_steps(self) -> list[dict[str, Any]]:
        """The steps trained in this session."""
        first = self.segments[-1]["first_step"]
        return [s for s in self.steps if s["step"] >= first]

    def summary(self) -> dict[str, Any]:
        """The summary block of ``metrics.json``."""
        schedule = self.schedule
        steady = self.measures[len(self.measures) // 5:] or self.measures
        session = self.session_steps
        ranks = range(self.world_size)
        validated = [s["val_loss"] for s in self.steps if "val_loss" in s]
        last: dict[str, Any] | None = None
        if self.traced:
            measured = measure_step(self.traced[-1][1], num_ranks=self.world_size)
            last = {"step": self.traced[-1][0], "makespan_seconds": measured.makespan,
                    "simulated_makespan_seconds": None}
            if schedule is not None:
                try:
                    last["simulated_makespan_seconds"] = simulate(schedule(), measured.mean_costs).makespan
                except (TypeError, ValueError) as error:
                    logger.debug("no simulator prediction: %s", error)
        throughput = [s["tokens_per_s"] for s in session[len(session) // 5:]]
        return {
            "first_loss": self.steps[0]["loss"] if self.steps else None,
            "final_loss": self.steps[-1]["loss"] if self.steps else None,
            "final_val_loss": validated[-1] if validated else None,
            "session_steps": len(session),
            "median_step_seconds": _median([s["seconds"] for s in session]),
            "median_tokens_per_s": _median(throughput),
            "median_bubble": _median([m.bubble_fraction for m in steady]),
            "median_busy_seconds_per_rank": [_median([m.busy[r] for m in steady]) for r in ranks] if steady else [],
            "median_idle_seconds_per_rank": [_median([m.idle[r] for m in steady]) for r in ranks] if steady else [],
            "last_step": last,
        }

    def metrics(self) -> dict[str, Any]:
        """The whole ``metrics.json`` value."""
        return {
            "schema": METRICS_SCHEMA,
            "config": {"args": self.options, "sources": self.sources,
                       "command_line": self.command_line, "world_size": self.world_size},
            "segments": self.segments,
            "steps": self.steps,
            "summary": self.summary(),
            "checkpoint": None if self.checkpoint_step is None else {"step": self.checkpoint_step,
                                                                     "folder": "checkpoint"},
            "stopped": self.stopped,
            "memory": self.memory,
            "sample": self.sample,
        }

    # -- writing ------------------------------------------------------------------------
    def write(self, *, pictures: bool = False, title: str = "") -> list[str]:
        """Write ``metrics.json`` (and, with ``pictures``, ``timeline.png`` and
        ``trace.json`` of the last steps); returns the names written."""
        with self._lock:
            return self._write(pictures=pictures, title=title)

    def _write(self, *, pictures: bool, title: str) -> list[str]:
        os.makedirs(self.out, exist_ok=True)
        write_json(os.path.join(self.out, "metrics.json"), self.metrics())
        self._written = time.monotonic()
        written = ["metrics.json"]
        if pictures and self.traced:
            step, timeline = self.traced[-1]
            render_measured_timeline(timeline, os.path.join(self.out, "timeline.png"),
                                     title=f"{title}: measured step {step}")
            write_chrome_trace([t for _, t in self.traced], os.path.join(self.out, "trace.json"),
                               step_numbers=[n for n, _ in self.traced],
                               metadata={"options": self.options, "layout": title})
            written += ["timeline.png", "trace.json"]
        if pictures and render_loss(self.steps, os.path.join(self.out, "loss.png"), title=title):
            written.append("loss.png")
        if pictures and self.memory and self.steps:
            self.tensorboard.memory(self.memory, int(self.steps[-1]["step"]))
        return written
