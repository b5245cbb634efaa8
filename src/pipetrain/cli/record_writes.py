"""Writes of a run's records that may fail without ending the run: one warning, then retries.

A record (``steps.jsonl``, ``metrics.json``, the pictures, TensorBoard events) that cannot
be written — a full disk, a quota, a read-only folder — must not stop the training it
describes, nor lose the steps trained so far. :class:`RecordWrites` runs each write;
the first one that fails for a file warns with one line naming the file, the space free
on *its* file system and the fix; training goes on and the caller tries again at its
next write. When a file can be written again, that is said once too.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from collections.abc import Callable
from typing import TypeVar

__all__ = ["RecordWrites", "free_space_line", "warn_on_stderr"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_WHY = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
        errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied"}


def warn_on_stderr(line: str) -> None:
    """Write ``pipetrain train: warning: LINE`` to stderr (the default warning)."""
    sys.stderr.write(f"pipetrain train: warning: {line}\n")
    sys.stderr.flush()


def free_space_line(path: str) -> str:
    """How much space is free on the file system that holds ``path`` (its folder, or the
    nearest folder above it that exists).

    Example:
        >>> free_space_line("/").endswith("free there")
        True
    """
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        free = shutil.disk_usage(folder or "/").free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free there"


class RecordWrites:
    """Runs the record writes of a run; a failed one warns once per file and returns
    ``None`` instead of raising.

    ``warn`` takes the warning's line (default: :func:`warn_on_stderr`).

    Example:
        >>> lines = []
        >>> writes = RecordWrites(warn=lines.append)
        >>> def full() -> None:
        ...     raise OSError(28, "No space left on device")
        >>> writes.run("/tmp/run/metrics.json", full) is None
        True
        >>> writes.run("/tmp/run/metrics.json", full) is None   # no second warning
        True
        >>> len(lines), lines[0].startswith("could not write '/tmp/run/metrics.json': no space")
        (1, True)
        >>> writes.run("/tmp/run/metrics.json", lambda: 1)
        1
        >>> lines[-1]
        "'/tmp/run/metrics.json' is written again"
    """

    def __init__(self, *, warn: Callable[[str], None] = warn_on_stderr) -> None:
        self.warn = warn
        self.failing: set[str] = set()
        """The files whose last write failed."""

    def run(self, path: str, write: Callable[[], T]) -> T | None:
        """``write()`` (which writes ``path``); ``None`` with a warning if it raised OSError."""
        try:
            result = write()
        except OSError as error:
            self.failed(path, error)
            return None
        self.succeeded(path)
        return result

    def failed(self, path: str, error: BaseException) -> None:
        """Note that writing ``path`` failed with ``error`` (warns the first time)."""
        if path in self.failing:
            logger.debug("writing %s failed again: %s", path, error)
            return
        self.failing.add(path)
        self.warn(self.describe(path, error))

    def succeeded(self, path: str) -> None:
        """Note that ``path`` was written (says so once if it had failed)."""
        if path in self.failing:
            self.failing.discard(path)
            self.warn(f"{path!r} is written again")

    @staticmethod
    def describe(path: str, error: BaseException) -> str:
        """The one line of a failed write of ``path``.

        Example:
            >>> RecordWrites.describe("/run/steps.jsonl", OSError(30, "Read-only file system")).split(";")[0]
            "could not write '/run/steps.jsonl': the file system is read-only"
        """
        code = getattr(error, "errno", None)
        why = _WHY.get(code, f"{type(error).__name__}: {error}") if code is not None else (
            f"{type(error).__name__}: {error}")
        fix = "make its folder writable"
        if code in (errno.ENOSPC, errno.EDQUOT):
            why += f" ({free_space_line(path)})"
            fix = "free space on that file system"
        return (f"could not write {path!r}: {why}; training goes on, the records wait in memory "
                f"and the write is tried again at the next one. Fix: {fix}")
