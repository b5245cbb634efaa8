"""The training progress bar: one line per update, redrawn in place on a terminal.

The one module of the library that writes to a stream, and only to the one it is given.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressBar", "format_duration", "format_rate"]


class ProgressBar:
    """Shows training progress on one line::

        step 12/200 [=====>      ] loss 2.314  12.3k tok/s  bubble 18%  ETA 1m20s

    On a terminal (``stream.isatty()``) every :meth:`update` rewrites the line in place
    (``\\r``); otherwise, so that logs stay readable, an update is written as a full
    line when ``log_every_steps`` steps or ``log_every_seconds`` seconds passed since
    the last line written (the first and the last step are always written). The ETA
    comes from the mean time per step since the bar was made (``initial_step`` is where
    a resumed run starts). :meth:`close` ends the line (and writes the last update if a
    non-terminal stream has not seen it); the bar is also a context manager. ``unit``
    names what is counted (``step``; ``layer`` for ``pipetrain profile``).

    Example:
        >>> import io
        >>> log = io.StringIO()
        >>> bar = ProgressBar(200, stream=log, bar_width=12, clock=lambda: 0.0)
        >>> bar.update(12, loss=2.3141, tokens_per_s=12345, bubble=0.18)
        >>> bar.close()
        >>> log.getvalue()
        'step 12/200 [>           ] loss 2.314  12.3k tok/s  bubble 18%\\n'

    Raises:
        ValueError: a bad setting (every problem is reported).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        bar_width: int = 20,
        log_every_steps: int = 10,
        log_every_seconds: float = 30.0,
        initial_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
        unit: str = "step",
    ) -> None:
        problems = []
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            problems.append(f"total_steps={total_steps!r}: give the number of steps, >= 1")
        if bar_width < 1:
            problems.append(f"bar_width={bar_width!r}: give at least 1 character")
        if log_every_steps < 1:
            problems.append(f"log_every_steps={log_every_steps!r}: give at least 1")
        if not log_every_seconds >= 0:
            problems.append(
                f"log_every_seconds={log_every_seconds!r}: give seconds >= 0 (math.inf: never)"
            )
        if problems:
            raise ValueError("invalid progress bar: " + "; ".join(problems))
        self.total_steps = total_steps
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.bar_width = bar_width
        self.log_every_steps = log_every_steps
        self.log_every_seconds = log_every_seconds
        self.initial_step = initial_step
        self.clock = clock
        self.unit = unit
        self.tty = _isatty(self.stream)
        self._started = clock()
        self._line = ""  # the last update's line
        self._written = ""  # the line currently on the terminal, or the last logged one
        self._logged_step: int | None = None
        self._logged_at = self._started
        self._closed = False

    def update(
        self,
        step: int,
        *,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        bubble: float | None = None,
    ) -> None:
        """Show that ``step`` steps are done; the figures are the latest ones (optional).

        ``bubble`` is a fraction (0.18 shows as ``18%``), as
        :attr:`~pipetrain.trace.StepMeasure.bubble_fraction`.

        Raises:
            ValueError: ``bubble`` is not a fraction between 0 and 1.
        """
        if bubble is not None and not 0 <= bubble <= 1:
            raise ValueError(f"bubble={bubble!r} must be a fraction in [0, 1] (0.18 for 18%)")
        now = self.clock()
        self._line = self._format(step, now, loss=loss, tokens_per_s=tokens_per_s, bubble=bubble)
        if self.tty:
            self._redraw(self._line)
        elif (
            self._logged_step is None
            or step >= self.total_steps
            or step - self._logged_step >= self.log_every_steps
            or now - self._logged_at >= self.log_every_seconds
        ):
            self._log(self._line, step, now)

    def close(self) -> None:
        """End the line; a non-terminal stream gets the last update if not yet written."""
        if self._closed:
            return
        self._closed = True
        if self.tty:
            if self._written:
                self.stream.write("\n")
        elif self._line and self._line != self._written:
            self.stream.write(self._line + "\n")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _redraw(self, line: str) -> None:
        padding = " " * max(0, len(self._written) - len(line))
        self.stream.write("\r" + line + padding)
        self.stream.flush()
        self._written = line

    def _log(self, line: str, step: int, now: float) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self._written, self._logged_step, self._logged_at = line, step, now

    def _format(
        self,
        step: int,
        now: float,
        *,
        loss: float | None,
        tokens_per_s: float | None,
        bubble: float | None,
    ) -> str:
        total = self.total_steps
        parts = []
        if loss is not None:
            parts.append(f"loss {loss:.3f}")
        if tokens_per_s is not None:
            parts.append(f"{format_rate(tokens_per_s)} tok/s")
        if bubble is not None:
            parts.append(f"bubble {bubble:.0%}")
        done = step - self.initial_step
        elapsed = now - self._started
        if 0 < done and elapsed > 0 and step < total:
            parts.append(f"ETA {format_duration(elapsed / done * (total - step))}")
        head = f"{self.unit} {step}/{total} [{self._bar(step)}]"
        return " ".join([head, "  ".join(parts)]) if parts else head

    def _bar(self, step: int) -> str:
        fraction = min(max(step / self.total_steps, 0.0), 1.0)
        filled = math.floor(fraction * self.bar_width)
        if filled >= self.bar_width:
            return "=" * self.bar_width
        return ("=" * filled + ">").ljust(self.bar_width)


def format_rate(value: float) -> str:
    """A rate with a k / M / G suffix, three significant digits.

    Example:
        >>> format_rate(950), format_rate(12345), format_rate(2.5e6)
        ('950', '12.3k', '2.50M')
    """
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor * 0.9995:  # what rounds to 1.00k is shown as such
            scaled = value / factor
            return f"{scaled:.3g}{suffix}" if abs(scaled) >= 100 else f"{scaled:#.3g}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """A duration as ``45s``, ``1m20s`` or ``2h03m``.

    Example:
        >>> format_duration(44.6), format_duration(80), format_duration(7380)
        ('45s', '1m20s', '2h03m')
    """
    if not math.isfinite(seconds):
        return "?"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
