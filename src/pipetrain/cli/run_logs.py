"""What a run shows outside its JSON: TensorBoard events and ``loss.png``.

TensorBoard event files go into the run folder itself, so ``tensorboard --logdir runs``
lists every run by its folder name. They are written with torch's own writer
(``torch.utils.tensorboard.SummaryWriter``), which needs the ``tensorboard`` package: the
``tensorboard`` extra of pipetrain (``pip install 'pipetrain[tensorboard]'``). Without
it the run trains as before and says once how to get the events. ``loss.png`` (training
and validation loss against the step) needs only matplotlib.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["TENSORBOARD_HINT", "TensorBoardLog", "render_loss"]

logger = logging.getLogger(__name__)

TENSORBOARD_HINT = ("TensorBoard events need the tensorboard package: pip install tensorboard "
                    "(or the extra: pip install 'pipetrain[tensorboard]'); the run trains without them")

_SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
            "grad_norm": "train/grad_norm", "tokens_per_s": "speed/tokens_per_s",
            "seconds": "speed/step_seconds", "bubble": "speed/bubble"}
"""The fields of a step record written as scalars, and their TensorBoard tags."""


class TensorBoardLog:
    """TensorBoard scalars of a run (rank 0), in event files in ``folder``.

    Example::

        log = TensorBoardLog("runs/a")
        log.step({"step": 1, "loss": 5.5, "lr": 0.01})
        log.close()
    """

    def __init__(self, folder: str) -> None:
        self.writer: Any = None
        self.missing: str | None = None
        """Why there are no events (``None``: they are written)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.missing = TENSORBOARD_HINT
            return
        os.makedirs(folder, exist_ok=True)
        self.writer = SummaryWriter(log_dir=folder, flush_secs=5)

    def step(self, record: dict[str, Any]) -> None:
        """Write the scalars of one step's record (the fields it has)."""
        if self.writer is None:
            return
        for field, tag in _SCALARS.items():
            value = record.get(field)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(tag, float(value), int(record["step"]))

    def memory(self, memory: Sequence[dict[str, Any]], step: int) -> None:
        """Write every rank's peak memory (bytes) at ``step``."""
        if self.writer is None:
            return
        for entry in memory:
            self.writer.add_scalar(f"memory/peak_bytes/rank_{entry['rank']}",
                                   float(entry["peak_memory_bytes"]), step)

    def flush(self) -> None:
        """Put what was written on disk."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def render_loss(steps: Sequence[dict[str, Any]], path: str, *, title: str = "") -> bool:
    """Draw the training loss (and validation loss, where recorded) against the step into
    ``path`` (PNG); whether there was anything to draw.

    Example::

        render_loss(metrics["steps"], "runs/a/loss.png", title="1f1b, 2 stages")
    """
    if not steps:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([s["step"] for s in steps], [s["loss"] for s in steps], label="training loss",
              linewidth=1)
    validated = [s for s in steps if "val_loss" in s]
    if validated:
        axes.plot([s["step"] for s in validated], [s["val_loss"] for s in validated], "o-",
                  label="validation loss", markersize=3)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.set_title(title or "loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True
