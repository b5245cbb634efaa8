"""Output of the benchmarks: strict JSON, and the formatters of their text reports."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["dump_json", "finite", "ms", "pct", "stage_ms"]


def finite(value: Any) -> Any:
    """``value`` with every NaN / infinity replaced by ``None`` (strict JSON).

    Example:
        >>> finite({"a": [1.0, float("nan")]})
        {'a': [1.0, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def dump_json(value: Any) -> str:
    """One strict JSON object (no NaN; unknown objects by ``to_dict()`` or ``str``)."""
    return json.dumps(finite(value), default=_default, allow_nan=False)


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, 7 wide; ``-`` for none.

    Example:
        >>> ms(0.0123)
        '   12.3'
    """
    return "-" if seconds is None or math.isnan(seconds) else f"{1e3 * seconds:7.1f}"


def pct(value: float | None) -> str:
    """A signed percentage; ``-`` for none.

    Example:
        >>> pct(0.051)
        '+5.1%'
    """
    return "-" if value is None or math.isnan(value) else f"{100 * value:+.1f}%"


def stage_ms(values: Sequence[float]) -> str:
    """Per-stage seconds as a list of milliseconds.

    Example:
        >>> stage_ms([0.001, 0.0025])
        '[1.00, 2.50]'
    """
    return "[" + ", ".join(f"{1e3 * v:.2f}" for v in values) + "]"
