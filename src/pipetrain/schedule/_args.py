"""Checks of the counts that schedule generators take, every problem reported at once."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_counts"]


def check_counts(counts: Mapping[str, tuple[object, int]], *, context: str) -> None:
    """Check that each ``name: (value, minimum)`` is an ``int`` of at least ``minimum``.

    Example:
        >>> check_counts({"num_stages": (4, 1)}, context="gpipe")
        >>> check_counts({"num_stages": (0, 1), "num_microbatches": (0, 1)}, context="gpipe")
        Traceback (most recent call last):
        ...
        ValueError: gpipe: num_stages must be at least 1, got 0; num_microbatches must be at least 1, got 0

    Raises:
        TypeError: a value is not an ``int`` (``bool`` included).
        ValueError: a value is below its minimum.
    """
    problems = []
    for name, (value, minimum) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{context}: {name} must be an int, got {value!r}")
        if value < minimum:
            problems.append(f"{name} must be at least {minimum}, got {value}")
    if problems:
        raise ValueError(f"{context}: " + "; ".join(problems))
