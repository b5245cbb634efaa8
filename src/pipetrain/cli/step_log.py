"""A run's per-step records, ``steps.jsonl``: one JSON line per step, appended as it ends.

The file is only ever appended to while a run trains, so recording a step costs the same
at step 100,000 as at step 10, and nothing of the history is kept in memory. A resumed
run starts its ``steps.jsonl`` with the steps of the run it continues up to its
checkpoint (steps after it are trained again); a run folder written before this file
existed continues from the ``steps`` of its ``metrics.json``.

A line that cannot be written (a full disk) stays in memory and is written with the
next one; a failed write is cut off the file, so the file only ever holds whole lines.
Non-finite numbers are written as ``null`` (strict JSON).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pipetrain.cli.record_writes import RecordWrites
from pipetrain.cli.run_folder import json_safe, read_json

__all__ = ["STEPS_FILE", "StepLog", "last_recorded", "read_steps"]

logger = logging.getLogger(__name__)

STEPS_FILE = "steps.jsonl"
"""The name of the per-step records in a run folder."""


def _lines(path: str, *, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The records of a ``steps.jsonl``, in its first ``limit`` bytes (all: ``None``); a
    last line cut short by a crash is left out."""
    read = 0
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            read += len(line)
            if not line.endswith(b"\n") or (limit is not None and read > limit):
                return  # a line being written when the process died, or after the limit
            try:
                record = json.loads(line)
            except ValueError:
                logger.warning("%s line %d is not JSON; left out", path, number)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                yield record


def read_steps(folder: str) -> Iterator[dict[str, Any]]:
    """The step records of the run in ``folder``: its ``steps.jsonl``, or the ``steps``
    of its ``metrics.json`` for a run written before ``steps.jsonl`` existed.

    Example:
        >>> list(read_steps("/nonexistent/run"))
        []
    """
    path = os.path.join(folder, STEPS_FILE)
    if os.path.exists(path):
        yield from _lines(path)
        return
    metrics = read_json(os.path.join(folder, "metrics.json")) or {}
    for record in metrics.get("steps") or []:
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            yield record


def last_recorded(folder: str) -> tuple[int, str] | None:
    """The last step recorded in the run folder ``folder`` and the file that says so
    (``steps.jsonl``, read from its end; or an older run's ``metrics.json``), or None.

    Example:
        >>> last_recorded("/nonexistent/run") is None
        True
    """
    path = os.path.join(folder, STEPS_FILE)
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - 65536))
            tail = file.read().split(b"\n")[:-1]  # whole lines only
    except FileNotFoundError:
        last = None
        for record in read_steps(folder):
            last = record
        return None if last is None else (int(last["step"]), os.path.join(folder, "metrics.json"))
    except OSError:
        return None
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return int(record["step"]), path
    return None


class StepLog:
    """The ``steps.jsonl`` of the run in ``folder``, appended one step at a time.

    ``history``: the run folder this run continues (may be ``folder`` itself); its steps
    before ``first_step`` start the file. ``on_record`` sees every record of the history
    in order as it is copied, to keep running figures without holding the records (from
    the first again if the disk refused the copy).

    Example::

        log = StepLog("runs/a", writes=RecordWrites(), first_step=1)
        log.append({"step": 1, "loss": 5.5})
        log.sync()                      # on disk (fsync), e.g. before a checkpoint
        [r["step"] for r in log.records()]   # [1]
    """

    def __init__(self, folder: str, *, writes: RecordWrites, first_step: int,
                 history: str | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = os.path.join(folder, STEPS_FILE)
        self.writes = writes
        self._lock = threading.RLock()
        self._pending: list[str] = []  # lines not written yet (the disk refused them)
        self._fd: int | None = None
        self._size = 0  # the file's length after its last whole line
        self._truncate = False  # the file must start again from the pending lines
        os.makedirs(folder, exist_ok=True)
        copied = writes.run(self.path, lambda: self._start(history, first_step, on_record))
        if copied is None:  # the disk refused the history: it waits in memory, like a step
            for record in read_steps(history) if history is not None else ():
                if record["step"] < first_step:
                    if on_record is not None:
                        on_record(record)
                    self._pending.append(_line(record))
            self._truncate = True

    def _start(self, history: str | None, first_step: int,
               on_record: Callable[[dict[str, Any]], None] | None) -> bool:
        """Write the history's steps before ``first_step`` as the file (a new file, then a
        rename: ``history`` may be this very folder)."""
        partial = f"{self.path}.partial"
        try:
            with open(partial, "w", encoding="utf-8") as file:
                for record in read_steps(history) if history is not None else ():
                    if record["step"] < first_step:
                        if on_record is not None:
                            on_record(record)
                        file.write(_line(record))
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, self.path)
        except OSError as error:
            if os.path.exists(partial):
                os.remove(partial)
            if error.filename is None:
                error.filename = self.path
            raise
        self._size = os.path.getsize(self.path)
        return True

    def append(self, record: dict[str, Any]) -> None:
        """Add one step's record (written now, or with a later one if the disk refuses)."""
        with self._lock:
            self._pending.append(_line(record))
            self.writes.run(self.path, self._write_pending)

    def sync(self) -> None:
        """Put every record on disk (fsync), e.g. before a checkpoint is saved."""
        with self._lock:
            if self.writes.run(self.path, self._write_pending) is not None and self._fd is not None:
                fd = self._fd
                self.writes.run(self.path, lambda: os.fsync(fd))

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record so far, the history first (those not written yet included)."""
        with self._lock:
            size, pending = self._size, list(self._pending)
            on_disk = os.path.exists(self.path) and not self._truncate
        if on_disk:
            yield from _lines(self.path, limit=size)
        for line in pending:
            yield json.loads(line)

    def close(self) -> None:
        """Write what is pending (if the disk takes it) and close the file."""
        with self._lock:
            self.sync()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _write_pending(self) -> bool:
        if not self._pending:
            return True
        data = "".join(self._pending).encode("utf-8")
        if self._fd is None or self._truncate:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if self._truncate else 0)
            self._fd = os.open(self.path, flags, 0o644)
            if self._truncate:
                self._size, self._truncate = 0, False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as error:
            if error.filename is None:
                error.filename = self.path
            try:
                os.ftruncate(self._fd, self._size)  # no half line stays in the file
            except OSError:
                logger.debug("could not cut %s back to %d bytes", self.path, self._size)
            raise
        self._size += len(data)
        self._pending.clear()
        return True


def _line(record: dict[str, Any]) -> str:
    return json.dumps(json_safe(record), allow_nan=False, separators=(", ", ": ")) + "\n"
