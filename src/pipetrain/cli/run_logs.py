"""What a run shows outside its JSON: TensorBoard events and ``loss.png``.

TensorBoard event files go into the run folder itself, so ``tensorboard --logdir runs``
lists every run by its folder name. They need the ``tensorboard`` package: the
``tensorboard`` extra of pipetrain (``pip install 'pipetrain[tensorboard]'``). Without
it the run trains as before and says once how to get the events.

Each step's scalars are one event, written and flushed by the training thread with the
tensorboard package's own event and record writers (what torch's ``SummaryWriter`` uses
underneath, without its writer thread: about ten times cheaper per step, and a failed
write is seen where it happens). Events that cannot be written (a full disk) do not
stop the run: one warning, and a new event file is tried :data:`RETRY_SECONDS` later.
``loss.png`` (training and validation loss against the step) needs only matplotlib.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO

from pipetrain.cli.record_writes import RecordWrites

__all__ = ["RETRY_SECONDS", "SCALARS", "TENSORBOARD_HINT", "TensorBoardLog", "render_loss",
           "step_scalars"]

logger = logging.getLogger(__name__)

TENSORBOARD_HINT = ("TensorBoard events need the tensorboard package: pip install tensorboard "
                    "(or the extra: pip install 'pipetrain[tensorboard]'); the run trains without them")

SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
            "grad_norm": "train/grad_norm", "tokens_per_s": "speed/tokens_per_s",
            "seconds": "speed/step_seconds", "bubble": "speed/bubble"}
"""The fields of a step record written as scalars, and their TensorBoard tags."""
RETRY_SECONDS = 30.0
"""Seconds after a failed write of the events before a new event file is tried."""


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a step's record (its finite numbers), by their tags.

    Example:
        >>> step_scalars({"step": 3, "loss": 2.5, "lr": 0.01, "grad_norm": float("nan")})
        {'train/loss': 2.5, 'train/lr': 0.01}
    """
    return {tag: float(record[field]) for field, tag in SCALARS.items()
            if isinstance(record.get(field), (int, float)) and math.isfinite(record[field])}


class TensorBoardLog:
    """TensorBoard scalars of a run (rank 0), in event files in ``folder``.

    A write that fails is reported through ``writes`` (one warning) and its file is
    dropped; the first write at least :data:`RETRY_SECONDS` later opens a new event file
    (TensorBoard reads them all).

    Example::

        log = TensorBoardLog("runs/a")
        log.step({"step": 1, "loss": 5.5, "lr": 0.01})
        log.close()
    """

    def __init__(self, folder: str, *, writes: RecordWrites | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = folder
        self.path = os.path.join(folder, "events.out.tfevents.*")
        """The event files (named in a warning)."""
        self.writes = RecordWrites() if writes is None else writes
        self.clock = clock
        self.missing: str | None = None
        """Why there are no events (``None``: they are written)."""
        self._file: BinaryIO | None = None
        self._records: Any = None
        self._failed_at: float | None = None
        self._closed = False
        self._opened = 0
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            self.missing = TENSORBOARD_HINT
            return
        self._event, self._summary, self._record_writer = Event, Summary, RecordWriter
        self._write({})

    def _open(self) -> None:
        """A new event file, its first event the file version (as TensorBoard expects)."""
        self._opened += 1
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{self._opened - 1}")
        os.makedirs(self.folder, exist_ok=True)
        self._file = open(os.path.join(self.folder, name), "ab")  # kept open: one event per step
        self._records = self._record_writer(self._file)
        self._records.write(self._event(wall_time=time.time(),
                                        file_version="brain.Event:2").SerializeToString())

    def _write(self, scalars: dict[str, float], step: int = 0) -> None:
        """One event of ``scalars`` (tag: value) at ``step``, flushed; none for ``{}``."""
        if self.missing is not None or self._closed:
            return
        if self._file is None and self._failed_at is not None \
                and self.clock() - self._failed_at < RETRY_SECONDS:
            return
        try:
            if self._file is None:
                self._open()
            if scalars:
                values = [self._summary.Value(tag=tag, simple_value=value)
                          for tag, value in scalars.items()]
                self._records.write(self._event(wall_time=time.time(), step=step,
                                                summary=self._summary(value=values)).SerializeToString())
            assert self._file is not None
            self._file.flush()
        except OSError as error:
            self._drop()
            self._failed_at = self.clock()
            self.writes.failed(self.path, error)
            return
        if self._failed_at is not None:
            self._failed_at = None
            self.writes.succeeded(self.path)

    def _drop(self) -> None:
        file, self._file, self._records = self._file, None, None
        if file is not None:
            try:
                file.close()
            except OSError:
                logger.debug("closing an event file in %s failed", self.folder)

    def step(self, record: dict[str, Any]) -> None:
        """Write the scalars of one step's record (the finite numbers it has)."""
        scalars = step_scalars(record)
        if scalars:
            self._write(scalars, int(record["step"]))

    def memory(self, memory: Sequence[dict[str, Any]], step: int) -> None:
        """Write every rank's peak memory (bytes) at ``step``."""
        self._write({f"memory/peak_bytes/rank_{entry['rank']}": float(entry["peak_memory_bytes"])
                     for entry in memory}, step)

    def flush(self) -> None:
        """Put what was written on disk (every event is flushed as it is written)."""
        if self._file is not None:
            self._write({})

    def close(self) -> None:
        """Close the event file (later writes are ignored)."""
        self._drop()
        self._closed = True


def render_loss(steps: Iterable[dict[str, Any]], path: str, *, title: str = "") -> bool:
    """Draw the training loss (and validation loss, where recorded) against the step into
    ``path`` (PNG); whether there was anything to draw. ``steps`` is read once (a loss
    recorded as ``None``, not finite, leaves a gap).

    Example::

        render_loss(metrics["steps"], "runs/a/loss.png", title="1f1b, 2 stages")
    """
    numbers: list[int] = []
    losses: list[float] = []
    validated: tuple[list[int], list[float]] = ([], [])
    for record in steps:
        numbers.append(int(record["step"]))
        losses.append(_number(record.get("loss")))
        if record.get("val_loss") is not None:
            validated[0].append(int(record["step"]))
            validated[1].append(_number(record["val_loss"]))
    if not numbers:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(numbers, losses, label="training loss", linewidth=1)
    if validated[0]:
        axes.plot(*validated, "o-", label="validation loss", markersize=3)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.set_title(title or "loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan
