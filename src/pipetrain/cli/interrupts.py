"""Ctrl-C held back while a command imports its heavy modules.

Some imports that torch makes (numpy's, among others) run code that swallows an exception
raised inside them, so a Ctrl-C that lands there is lost: the command goes on as if
nothing happened. While :func:`deferred_interrupt` is active SIGINT only sets a flag, and
the interrupt is raised as ``KeyboardInterrupt`` once the block is done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["deferred_interrupt"]


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold SIGINT while the block runs; raise ``KeyboardInterrupt`` after it if one came
    (main thread only; elsewhere the block runs as is).

    Example:
        >>> with deferred_interrupt():
        ...     import json  # a Ctrl-C here is raised after the import, never lost
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def remember(number: int, frame: FrameType | None) -> None:
        seen.append(number)

    previous = signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen and previous is not signal.SIG_IGN:
        raise KeyboardInterrupt
