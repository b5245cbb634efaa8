"""What a run shows outside its JSON: TensorBoard events and ``loss.png``.

TensorBoard event files go into the run folder itself, so ``tensorboard --logdir runs``
lists every run by its folder name. They are written with torch's own writer
(``torch.utils.tensorboard.SummaryWriter``), which needs the ``tensorboard`` package: the
``tensorboard`` extra of pipetrain (``pip install 'pipetrain[tensorboard]'``). Without
it the run trains as before and says once how to get the events. Events that cannot be
written (a full disk) do not stop the run: one warning, and a new event file is tried
:data:`RETRY_SECONDS` later. ``loss.png`` (training and validation loss against the
step) needs only matplotlib.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pipetrain.cli.record_writes import RecordWrites

__all__ = ["RETRY_SECONDS", "TENSORBOARD_HINT", "TensorBoardLog", "render_loss"]

logger = logging.getLogger(__name__)

TENSORBOARD_HINT = ("TensorBoard events need the tensorboard package: pip install tensorboard "
                    "(or the extra: pip install 'pipetrain[tensorboard]'); the run trains without them")

_SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
            "grad_norm": "train/grad_norm", "tokens_per_s": "speed/tokens_per_s",
            "seconds": "speed/step_seconds", "bubble": "speed/bubble"}
"""The fields of a step record written as scalars, and their TensorBoard tags."""
RETRY_SECONDS = 30.0
"""Seconds after a failed write of the events before a new event file is tried."""


class TensorBoardLog:
    """TensorBoard scalars of a run (rank 0), in event files in ``folder``.

    A write that fails (the writer's thread found the disk full) is reported through
    ``writes`` (one warning) and the writer is dropped; the first write at least
    :data:`RETRY_SECONDS` later opens a new event file (TensorBoard reads them all).

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
        self.writer: Any = None
        self.missing: str | None = None
        """Why there are no events (``None``: they are written)."""
        self._failed_at: float | None = None
        self._closed = False
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.missing = TENSORBOARD_HINT
            return
        self._open: Callable[..., Any] = SummaryWriter
        self._use(lambda writer: None)

    def _use(self, write: Callable[[Any], None]) -> None:
        """``write(writer)``, the writer opened first if it is not (and a retry is due);
        a write that fails warns and drops the writer."""
        if self.missing is not None or self._closed:
            return
        if self.writer is None and self._failed_at is not None \
                and self.clock() - self._failed_at < RETRY_SECONDS:
            return
        try:
            if self.writer is None:
                self.writer = self._open(log_dir=self.folder, flush_secs=5)
            write(self.writer)
        except OSError as error:
            writer, self.writer, self._failed_at = self.writer, None, self.clock()
            if writer is not None:
                try:
                    writer.close()
                except OSError:
                    logger.debug("closing the failed event file in %s failed too", self.folder)
            self.writes.failed(self.path, error)
            return
        if self._failed_at is not None:
            self._failed_at = None
            self.writes.succeeded(self.path)

    def step(self, record: dict[str, Any]) -> None:
        """Write the scalars of one step's record (the finite numbers it has)."""
        def write(writer: Any) -> None:
            for field, tag in _SCALARS.items():
                value = record.get(field)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(tag, float(value), int(record["step"]))

        self._use(write)

    def memory(self, memory: Sequence[dict[str, Any]], step: int) -> None:
        """Write every rank's peak memory (bytes) at ``step``."""
        def write(writer: Any) -> None:
            for entry in memory:
                writer.add_scalar(f"memory/peak_bytes/rank_{entry['rank']}",
                                  float(entry["peak_memory_bytes"]), step)

        self._use(write)

    def flush(self) -> None:
        """Put what was written on disk."""
        if self.writer is not None:
            self._use(lambda writer: writer.flush())

    def close(self) -> None:
        """Flush and close the event file (later writes are ignored)."""
        if self.writer is not None:
            self._use(lambda writer: writer.close())
        self.writer = None
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
