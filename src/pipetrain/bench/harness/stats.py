"""Medians, quartiles and summaries of repeated measurements."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["median", "quartiles", "summary"]


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values.

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
    """
    return statistics.median(values) if values else math.nan


def quartiles(values: Sequence[float]) -> list[float]:
    """``[first quartile, third quartile]`` (both the value itself for one value).

    Example:
        >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
        [1.5, 4.5]
    """
    if len(values) < 2:
        return [values[0], values[0]] if values else [math.nan, math.nan]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles, minimum and count of ``values`` (seconds, say).

    Example:
        >>> summary([1.0, 2.0, 3.0])["median_s"]
        2.0
    """
    return {"median_s": median(values), "quartiles_s": quartiles(values),
            "min_s": min(values) if values else math.nan, "reps": len(values)}
