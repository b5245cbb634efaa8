"""Warnings about measurements that cannot be trusted: repetitions that disagree, a busy machine.

A timing is a median of repetitions; when the repetitions spread widely, or when the
machine had more runnable work than cores (its load average above the core count), the
median can be off by more than the differences it is meant to show. These helpers turn
both conditions into one-line warnings that a report prints beside its figures; they
are plain functions of numbers, for ``pipetrain bench`` as for any command that times
something (``pipetrain profile``, ``pipetrain plan``).

Example:
    >>> spread_warning("pipetrain gpipe", [0.100, 0.101, 0.180, 0.099])
    'pipetrain gpipe: repetitions disagree (spread 61% of the median 0.1, 4 values; more than 10%)'
    >>> load_warning([3.5, 2.0, 1.0], cores=2)
    'load average 3.5 above the 2 cores: other work shared the CPU, timings are not comparable'
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence

from pipetrain.bench.harness.machine import usable_cores

__all__ = ["SPREAD_TOLERANCE", "load_warning", "measurement_warnings", "relative_spread",
           "spread_warning", "spread_warnings"]

SPREAD_TOLERANCE = 0.10
"""Repetitions whose interquartile range exceeds this share of their median disagree."""


def relative_spread(values: Sequence[float]) -> float | None:
    """The spread of ``values`` over their median: the interquartile range from 4 values
    on, else max - min (``None``: fewer than 2 values, or a median of 0).

    Example:
        >>> relative_spread([1.0, 1.0, 1.2])
        0.19999999999999996
        >>> relative_spread([2.0]) is None
        True
    """
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    if middle == 0:
        return None
    if len(values) < 4:
        return (max(values) - min(values)) / abs(middle)
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / abs(middle)


def spread_warning(label: str, values: Sequence[float], *,
                   tolerance: float = SPREAD_TOLERANCE) -> str | None:
    """A warning when the repetitions ``values`` of ``label`` spread more than
    ``tolerance`` of their median (``None``: they agree, or too few to tell).

    Example:
        >>> spread_warning("plain", [0.20, 0.21, 0.20]) is None
        True
    """
    spread = relative_spread(values)
    if spread is None or spread <= tolerance:
        return None
    return (f"{label}: repetitions disagree (spread {spread:.0%} of the median "
            f"{statistics.median(values):.2g}, {len(values)} values; more than "
            f"{tolerance:.0%})")


def load_warning(load_average: Sequence[float] | None = None, *,
                 cores: int | None = None) -> str | None:
    """A warning when the 1-minute load average (default: now) is above the number of
    cores (default: those this process may use).

    Example:
        >>> load_warning([0.5, 0.5, 0.5], cores=2) is None
        True
    """
    if load_average is None:
        if not hasattr(os, "getloadavg"):
            return None
        load_average = os.getloadavg()
    if cores is None:
        cores = usable_cores() or os.cpu_count() or 1
    if not load_average or load_average[0] <= cores:
        return None
    return (f"load average {load_average[0]:.1f} above the {cores} cores: other work shared "
            f"the CPU, timings are not comparable")


def spread_warnings(samples: Mapping[str, Sequence[float]], *,
                    tolerance: float = SPREAD_TOLERANCE) -> list[str]:
    """A warning per label of ``samples`` (repetitions by label) whose values disagree.

    Example:
        >>> spread_warnings({"a": [1.0, 1.0, 1.0], "b": [1.0, 1.5]})
        ['b: repetitions disagree (spread 40% of the median 1.2, 2 values; more than 10%)']
    """
    found = [spread_warning(label, values, tolerance=tolerance)
             for label, values in samples.items()]
    return [w for w in found if w is not None]


def measurement_warnings(samples: Mapping[str, Sequence[float]], *,
                         load_average: Sequence[float] | None = None,
                         cores: int | None = None,
                         tolerance: float = SPREAD_TOLERANCE) -> list[str]:
    """Every warning about ``samples`` (repetitions by label) and the machine's load.

    Example:
        >>> measurement_warnings({"a": [1.0, 1.0, 1.0], "b": [1.0, 2.0, 1.0]},
        ...                      load_average=[0.1, 0.1, 0.1], cores=2)
        ['b: repetitions disagree (spread 100% of the median 1, 3 values; more than 10%)']
    """
    busy = load_warning(load_average, cores=cores)
    return [*spread_warnings(samples, tolerance=tolerance), *([busy] if busy else [])]
