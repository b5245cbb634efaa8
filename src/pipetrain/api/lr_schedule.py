"""The learning-rate schedules of ``pipetrain train``: a linear warm-up, then a decay.

A multiplier of the base learning rate per step, for
:class:`torch.optim.lr_scheduler.LambdaLR`; the benchmarks that train as
``pipetrain train`` does use the same one. After ``warmup`` steps (the multiplier rising
linearly to 1):

- ``cosine`` (the default): a cosine from 1 down to ``min_ratio`` at step ``total``;
- ``linear``: a straight line from 1 down to ``min_ratio`` at step ``total``;
- ``constant``: 1;
- ``wsd`` (warm-up, stable, decay): 1 until the last ``decay_fraction`` of the steps, then
  a straight line down to ``min_ratio`` at step ``total``.

Past ``total`` the multiplier stays where the schedule ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["LR_SCHEDULES", "lr_factor"]

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""The schedules :func:`lr_factor` knows."""


def lr_factor(warmup: int, total: int, *, schedule: str = "cosine", min_ratio: float = 0.1,
              decay_fraction: float = 0.2) -> Callable[[int], float]:
    """The LR multiplier of each step (see the module docstring).

    Raises:
        ValueError: an unknown ``schedule``, or ``min_ratio`` / ``decay_fraction`` outside
            [0, 1].

    Example:
        >>> factor = lr_factor(2, 10)
        >>> [round(factor(step), 3) for step in (0, 1, 2, 6, 10, 20)]
        [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
        >>> [round(lr_factor(0, 10, schedule="wsd", min_ratio=0.0)(s), 2) for s in (0, 8, 9, 10)]
        [1.0, 1.0, 0.5, 0.0]
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {', '.join(LR_SCHEDULES)}")
    for name, value in (("min_ratio", min_ratio), ("decay_fraction", decay_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value!r} must be within [0, 1]")
    decay_start = max(warmup, total - round(decay_fraction * (total - warmup)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        start = decay_start if schedule == "wsd" else warmup
        progress = min(1.0, max(0.0, (step - start) / max(1, total - start)))
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - min_ratio) * progress

    return factor
