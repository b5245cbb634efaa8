"""The min-max contiguous partition: cut a sequence of costs into K contiguous parts.

:func:`solve` minimizes the largest partition cost exactly (dynamic programming over
prefix sums, O(K N log N)); among the cuts that reach that optimum it picks the most
even one (smallest sum of squared partition costs, then of partition sizes), with
remaining ties going to the cut whose later partitions are larger.

It is the one solver of this problem in pipetrain: torchgpipe's balancers
(:func:`pipetrain.partition.balance_by_time`, ``balance_by_size``) call it on the
profiler's per-layer costs, and the planner calls it for a straight pipeline whose
stage times are the sums of its layers' (:mod:`pipetrain.plan.straight`). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["solve"]


def _check(costs: Sequence[float], num_partitions: int) -> None:
    problems = []
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        problems.append(f"num_partitions must be an integer, got {num_partitions!r}")
    elif num_partitions < 1:
        problems.append(f"num_partitions must be at least 1, got {num_partitions}")
    elif len(costs) < num_partitions:
        problems.append(
            f"cannot cut {len(costs)} layers into {num_partitions} partitions (each needs "
            f"at least one layer); use at most {len(costs)} partitions"
        )
    bad = [(i, c) for i, c in enumerate(costs) if not (math.isfinite(c) and c >= 0)]
    if bad:
        shown = ", ".join(f"costs[{i}] = {c!r}" for i, c in bad[:5])
        problems.append(f"costs must be finite and non-negative, got {shown}")
    if problems:
        raise ValueError(
            "cannot balance: " + "; ".join(problems) + "; fix: e.g. solve([3, 1, 1, 2], 2)"
        )


def _min_max(prefix: list[float], num_partitions: int) -> float:
    """The smallest achievable largest partition cost."""
    n = len(prefix) - 1
    # best[i]: optimum for the first i layers in p partitions; starts at p = 1.
    best = list(prefix)
    for p in range(2, num_partitions + 1):
        current = [math.inf] * (n + 1)
        for i in range(p, n + 1):
            # Last partition = layers t..i-1. best[t] grows with t, the last cost
            # shrinks: the optimum sits where they cross.
            lo, hi = p - 1, i - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if best[mid] >= prefix[i] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            value = max(best[lo], prefix[i] - prefix[lo])
            if lo > p - 1:
                value = min(value, max(best[lo - 1], prefix[i] - prefix[lo - 1]))
            current[i] = value
        best = current
    return best[n]


def solve(costs: Sequence[float], num_partitions: int) -> list[int]:
    """Cut ``costs`` into ``num_partitions`` contiguous, non-empty partitions.

    Returns the number of layers in each partition (a ``balance``). The largest
    partition cost is the smallest possible; among such cuts, the most even.

    Raises:
        ValueError: ``num_partitions`` below 1 or above ``len(costs)``, or a cost that
            is negative, NaN or infinite.

    Example:
        >>> solve([1, 1, 1, 1], 2)
        [2, 2]
        >>> solve([1, 1, 8, 1, 1], 3)
        [2, 1, 2]
    """
    _check(costs, num_partitions)
    n = len(costs)
    prefix = [0.0] * (n + 1)
    for i, cost in enumerate(costs):
        prefix[i + 1] = prefix[i] + cost
    limit = _min_max(prefix, num_partitions)

    # Among cuts with every partition <= limit (computed the same way, so the
    # optimum's cut qualifies): minimize (sum of cost^2, sum of size^2).
    inf = (math.inf, math.inf)
    score: list[tuple[float, float]] = [inf] * (n + 1)
    for i in range(1, n + 1):
        if prefix[i] <= limit:
            score[i] = (prefix[i] ** 2, float(i * i))
    starts: list[list[int]] = [[0] * (n + 1)]
    for p in range(2, num_partitions + 1):
        current = [inf] * (n + 1)
        start = [-1] * (n + 1)
        for i in range(p, n + 1):
            t = i - 1
            while t >= p - 1 and prefix[i] - prefix[t] <= limit:
                if score[t] != inf:
                    cost = prefix[i] - prefix[t]
                    candidate = (score[t][0] + cost**2, score[t][1] + float((i - t) ** 2))
                    if candidate <= current[i]:  # ties: the longer last partition
                        current[i], start[i] = candidate, t
                t -= 1
        score = current
        starts.append(start)

    balance = []
    i = n
    for p in range(num_partitions, 1, -1):
        t = starts[p - 1][i]
        assert t >= 0, "the min-max cut must satisfy its own limit"
        balance.append(i - t)
        i = t
    balance.append(i)
    return balance[::-1]
