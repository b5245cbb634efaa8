"""The records of a training run (rank 0): ``steps.jsonl``, ``metrics.json``, the pictures.

Each step's record is appended to ``steps.jsonl`` as the step ends (:mod:`.step_log`):
recording a step costs the same at step 100,000 as at step 10, and rank 0 keeps no
history in memory, only running figures and the last :data:`WINDOW` steps' measures for
the summary's medians. The file is put on disk (fsync) before every checkpoint, so the
history never falls behind a checkpoint.

``metrics.json`` holds the whole run: the options of each session (a resumed run carries
the history of the run it continues, the steps up to its checkpoint, and adds a
*segment*), every step's record (streamed from ``steps.jsonl``), the summary and how the
run ended. It is written when a session starts and when it ends, stops or fails (a
worker that is about to be ended writes it from another thread: :meth:`RunRecords.stop`).
Its fields are documented in ``docs/run-folder.md``.

A record that cannot be written (a full disk) does not stop the run: one warning, and the
write is tried again at the next one (:mod:`.record_writes`).
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pipetrain.cli.record_writes import RecordWrites
from pipetrain.cli.restarts import restarts_seen
from pipetrain.cli.run_folder import read_json, write_json
from pipetrain.cli.run_logs import render_loss
from pipetrain.cli.step_log import StepLog
from pipetrain.cli.trackers import open_trackers
from pipetrain.schedule import Schedule, TimedAction, simulate
from pipetrain.trace import StepMeasure, measure_step, render_measured_timeline, write_chrome_trace

__all__ = ["METRICS_SCHEMA", "WINDOW", "RunRecords"]

logger = logging.getLogger(__name__)

METRICS_SCHEMA = 3
"""Version of the ``metrics.json`` layout (``docs/run-folder.md``)."""
WINDOW = 1000
"""How many of a session's last steps the summary's medians cover, at most."""
_TRACE_STEPS = 3
"""How many final steps go into trace.json."""


def _median(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return statistics.median(finite) if finite else None


@dataclass(frozen=True)
class _Measured:
    """What the summary keeps of one step of the session."""

    seconds: float
    tokens_per_s: float
    bubble: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]


class RunRecords:
    """What rank 0 records about a run, and the files it writes.

    ``history`` is the folder whose records this run continues (None for a new run); its
    steps from ``first_step`` on (past the checkpoint) are dropped. ``warn`` takes the
    line of a record that could not be written (default: stderr).

    Example::

        records = RunRecords("runs/a", options, world_size=2, first_step=1)
        records.write()                                 # metrics.json at the start
        records.add({"step": 1, "loss": 5.5, ...}, measure, timeline)
        records.logged(record)                          # steps.jsonl, TensorBoard
        records.write(pictures=True, title="...")       # at the end
    """

    def __init__(self, out: str, options: dict[str, Any], *, world_size: int, first_step: int,
                 history: str | None = None, changes: dict[str, tuple[Any, Any]] | None = None,
                 checkpoint_step: int | None = None,
                 warn: Callable[[str], None] | None = None, log: str = "tensorboard") -> None:
        self.out = out
        self.options = options
        self.world_size = world_size
        self.writes = RecordWrites() if warn is None else RecordWrites(warn=warn)
        self.segments: list[dict[str, Any]] = []
        earlier: dict[str, Any] = {}
        if history is not None:
            earlier = read_json(os.path.join(history, "metrics.json")) or {}
            self.segments = [dict(g) for g in earlier.get("segments", []) if g.get("first_step", 0) < first_step]
        self.restarts = restarts_seen(earlier.get("restarts"))
        """The run's automatic restarts (see :mod:`.restarts`)."""
        self.segments.append({
            "first_step": first_step,
            "args": options,
            "changed": {name: list(pair) for name, pair in (changes or {}).items()},
        })
        self.first_loss: float | None = None
        """The loss of the run's first recorded step."""
        self.last: dict[str, Any] | None = None
        """The record of the run's last step."""
        self.last_val_loss: float | None = None
        """The run's last validation loss."""
        self.session_first: dict[str, Any] | None = None
        """The record of this session's first step."""
        self.session_count = 0
        """How many steps this session trained."""
        self._window: collections.deque[_Measured] = collections.deque(maxlen=WINDOW)
        self._unlogged: dict[str, Any] | None = None
        self.steps = StepLog(out, writes=self.writes, first_step=first_step, history=history,
                             on_record=self._seen)
        """The run's steps (``steps.jsonl``)."""
        self.traced: list[tuple[int, list[TimedAction]]] = []
        self.checkpoint_step = checkpoint_step
        """The step of the run's newest checkpoint (None before the first save)."""
        self.stopped: dict[str, Any] | None = None
        self.memory: list[Any] | None = None
        self.monitor: list[Any] | None = None
        """Per rank, the failure detector's store calls per second (at the run's end)."""
        self.sample: str | None = None
        """The sampled text (written to ``sample.txt`` too)."""
        self.schedule: Callable[[], Schedule] | None = None
        """The schedule of a step (for the simulator's makespan in the summary)."""
        self.sources: dict[str, str] = {}
        """Where each option came from (``default``, ``command line``, ``plan``...)."""
        self.command_line: list[str] = []
        """The command line as typed."""
        self.mesh: dict[str, Any] | None = None
        """The mesh that ran (:func:`pipetrain.api.mesh.mesh_record`), in metrics.json's
        config and the trace's metadata."""
        self._lock = threading.RLock()
        self.trackers = open_trackers(log, out, options=options, writes=self.writes)
        """TensorBoard events in the run folder (see :mod:`.run_logs`) and the other
        trackers ``--log`` names (see :mod:`.trackers`)."""

    # -- recording ----------------------------------------------------------------------
    def _seen(self, record: dict[str, Any]) -> None:
        """Keep the running figures of the run up to ``record`` (the next in order)."""
        if self.last is None or int(record["step"]) <= int(self.last["step"]):
            self.first_loss = record.get("loss")  # the first record (or the history again)
            self.last_val_loss = None
        self.last = record
        if record.get("val_loss") is not None:
            self.last_val_loss = record["val_loss"]

    def add(self, record: dict[str, Any], measure: StepMeasure, timeline: list[TimedAction]) -> None:
        """Record one step (its ``record``, the measure and timeline of its actions); the
        record is written by :meth:`logged`, once it is complete."""
        with self._lock:
            self._unlogged = record
            self.session_count += 1
            if self.session_first is None:
                self.session_first = record
                back = self.restarts[-1] if self.restarts else None
                if back is not None and "failed_at_unix" in back and "seconds_to_next_step" not in back:
                    back["seconds_to_next_step"] = round(time.time() - back["failed_at_unix"], 2)
            self._window.append(_Measured(
                float(record["seconds"]), float(record["tokens_per_s"]), measure.bubble_fraction,
                tuple(measure.busy[r] for r in range(self.world_size)),
                tuple(measure.idle[r] for r in range(self.world_size))))
            self.traced = [*self.traced, (int(record["step"]), timeline)][-_TRACE_STEPS:]

    def logged(self, record: dict[str, Any]) -> None:
        """Write a step's record (once it is complete: validation loss included) to
        ``steps.jsonl`` and TensorBoard."""
        with self._lock:
            if record is not self._unlogged:  # written already (by stop) or never added
                return
            self._unlogged = None
            self._seen(record)
            self.steps.append(record)
            for tracker in self.trackers:
                tracker.step(record)

    def close(self) -> None:
        """Close ``steps.jsonl`` and the TensorBoard events (the run ends)."""
        with self._lock:
            self.steps.close()
            for tracker in self.trackers:
                tracker.close()

    def sync(self) -> None:
        """Put the steps recorded so far on disk (before a checkpoint is saved: the
        history never falls behind it)."""
        with self._lock:
            self.steps.sync()

    def stop(self, stopped: dict[str, Any]) -> None:
        """Record how the run ended and write the records (safe from another thread, e.g.
        just before the worker is ended; an earlier ``stopped`` is kept)."""
        with self._lock:
            if self.stopped is None:
                self.stopped = stopped
            if self._unlogged is not None:  # its step ended, its validation did not
                self.logged(self._unlogged)
            self.write()
            for tracker in self.trackers:
                tracker.flush()

    def summary(self) -> dict[str, Any]:
        """The summary block of ``metrics.json``."""
        schedule = self.schedule
        window = list(self._window)
        steady = window[-(self.session_count - self.session_count // 5):] if window else []
        ranks = range(self.world_size)
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
        return {
            "first_loss": self.first_loss,
            "final_loss": None if self.last is None else self.last.get("loss"),
            "final_val_loss": self.last_val_loss,
            "session_steps": self.session_count,
            "median_step_seconds": _median(m.seconds for m in window),
            "median_tokens_per_s": _median(m.tokens_per_s for m in steady),
            "median_bubble": _median(m.bubble for m in steady),
            "median_busy_seconds_per_rank": [_median(m.busy[r] for m in steady) for r in ranks] if steady else [],
            "median_idle_seconds_per_rank": [_median(m.idle[r] for m in steady) for r in ranks] if steady else [],
            "last_step": last,
        }

    def metrics(self) -> dict[str, Any]:
        """The value of ``metrics.json``, but for its ``steps`` (``None`` here: they are
        streamed from ``steps.jsonl`` when the file is written)."""
        return {
            "schema": METRICS_SCHEMA,
            "config": {"args": self.options, "sources": self.sources,
                       "command_line": self.command_line, "world_size": self.world_size,
                       "mesh": self.mesh},
            "segments": self.segments,
            "steps": None,
            "summary": self.summary(),
            "checkpoint": None if self.checkpoint_step is None else {"step": self.checkpoint_step,
                                                                     "folder": "checkpoint"},
            "stopped": self.stopped,
            "restarts": self.restarts,
            "memory": self.memory,
            "monitor": self.monitor,
            "sample": self.sample,
        }

    # -- writing ------------------------------------------------------------------------
    def write(self, *, pictures: bool = False, title: str = "") -> list[str]:
        """Write ``metrics.json`` (and ``sample.txt`` once there is a sample; with
        ``pictures``, ``timeline.png``, ``trace.json`` and ``loss.png``); returns the names
        written. A file that cannot be written is left out with a warning."""
        with self._lock:
            self.steps.sync()
            written = []
            metrics = self.metrics()
            if self._write("metrics.json", lambda path: write_json(
                    path, metrics, rows=("steps", self.steps.records()))):
                written.append("metrics.json")
            if self.sample is not None and self._write("sample.txt", self._write_sample):
                written.append("sample.txt")
            if pictures:
                written += self._pictures(title)
            return written

    def _write(self, name: str, write: Callable[[str], None]) -> bool:
        path = os.path.join(self.out, name)
        return self.writes.run(path, lambda: _named(path, write)) is not None

    def _write_sample(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.sample or "")

    def _pictures(self, title: str) -> list[str]:
        written = []
        if self.traced:
            step, timeline = self.traced[-1]
            if self._write("timeline.png", lambda path: render_measured_timeline(
                    timeline, path, title=f"{title}: measured step {step}")):
                written.append("timeline.png")
            if self._write("trace.json", lambda path: write_chrome_trace(
                    [t for _, t in self.traced], path, step_numbers=[n for n, _ in self.traced],
                    metadata={"options": self.options, "layout": title, "mesh": self.mesh})):
                written.append("trace.json")
        drawn: list[bool] = []
        if self._write("loss.png", lambda path: drawn.append(
                render_loss(self.steps.records(), path, title=title))) and drawn[0]:
            written.append("loss.png")
        if self.memory and self.last is not None:
            for tracker in self.trackers:
                tracker.memory(self.memory, int(self.last["step"]))
        return written


def _named(path: str, write: Callable[[str], None]) -> bool:
    """Run ``write(path)``; an OSError without a file name gets ``path`` (for its warning)."""
    try:
        write(path)
    except OSError as error:
        if error.filename is None:
            error.filename = path
        raise
    return True
