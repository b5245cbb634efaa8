"""The learning-rate schedule of ``pipetrain train``: linear warm-up, then a cosine to 0.1.

A multiplier of the base learning rate per step, for
:class:`torch.optim.lr_scheduler.LambdaLR`; the benchmarks that train as
``pipetrain train`` does use the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["lr_factor"]


def lr_factor(warmup: int, total: int) -> Callable[[int], float]:
    """The LR multiplier of each step: ``(step + 1) / warmup`` for the first ``warmup``
    steps, then a cosine from 1 down to 0.1 at step ``total`` (and 0.1 after it).

    Example:
        >>> factor = lr_factor(2, 10)
        >>> [round(factor(step), 3) for step in (0, 1, 2, 6, 10, 20)]
        [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
