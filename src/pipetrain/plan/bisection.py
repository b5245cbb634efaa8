"""Finding the smallest feasible limit: bisection with a certificate of exactness.

A search over plans (:mod:`pipetrain.plan.search`) answers one question fast: is there
a plan whose slowest stage takes at most ``T``? :func:`minimize` turns that into the
smallest such ``T``. It bisects on ``T`` in log space, lowering the upper end to the
value of each plan found (often well below the probed limit) and following the
search's own guesses while they at least halve the bracket; once the bracket is narrow
it tries each plan found as the answer at once, and asks for every value inside where a
probe's answer can change (the stage times there) to bisect that finite list. It ends with a certificate: a probe "strictly
below the answer" that finds nothing, so the answer is exact, not within a tolerance.

Example:
    >>> plans = [5.0, 3.0, 2.5]            # the values of the plans there are
    >>> probe = lambda limit: min((v for v in plans if v <= limit), default=None)
    >>> minimize(probe, lambda plan: plan)
    (2.5, 2.5)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

__all__ = ["minimize"]

P = TypeVar("P")
"""A plan, whatever the search represents it as."""

_REL = 1e-10
"""Relative bracket width at which the bisection asks for its certificate."""
_CERTIFY = 1e-3
"""Below this relative width, a plan found is tried as the answer at once."""


def minimize(
    probe: Callable[[float], P | None],
    value: Callable[[P], float],
    *,
    below: float = 0.0,
    guess: Callable[[float, P | None], float] | None = None,
    events: Callable[[float, float], set[float] | None] | None = None,
) -> tuple[P, float] | None:
    """The smallest ``value(plan)`` over the plans ``probe(limit)`` can return.

    ``probe(limit)`` must return a plan with ``value <= limit`` whenever one exists, and
    None otherwise; ``below`` is a value known to have no plan strictly under it (0: none
    known), tried first. Bisects on the limit: each plan found lowers the upper end to
    its own value; ``guess(limit, plan)`` may suggest the next limit from what the last
    probe saw (followed while it at least halves the bracket); once the bracket is narrow,
    ``events(low, high)`` may list every value in it where a probe's answer can change,
    and the search finishes by bisecting that list. It ends with a certificate: no plan
    is strictly below the answer. None when ``probe(inf)`` finds nothing.

    Example:
        >>> minimize(lambda limit: 3.0 if limit >= 3.0 else None, lambda plan: plan)
        (3.0, 3.0)
    """
    if below > 0:  # often the answer itself
        found = probe(below)
        if found is not None:
            return found, value(found)
    plan = probe(math.inf)
    if plan is None:
        return None
    high = value(plan)
    low = below  # no plan at or below it (0: unknown)
    suggestion = guess(math.inf, plan) if guess is not None else 0.0
    trust, next_events, certify = True, 1e-4, False
    while high > 0:
        width = math.log(high / low) if low > 0 else math.inf
        if events is not None and width < next_events:
            next_events = width / 100
            values = events(low, high)
            if values is not None:
                return _finish(probe, value, sorted(v for v in values if v < high), plan, high)
        if certify or (low > 0 and high <= low * (1 + _REL)):
            # a plan found in a narrow bracket is most often the optimum: try to certify
            certify = False
            lower = probe(math.nextafter(high, 0.0))
            if lower is None:
                break
            plan, high = lower, value(lower)
            continue
            lower = probe(math.nextafter(high, 0.0))
            if lower is None:
                break
            plan, high = lower, value(lower)
            continue
        if trust and low < suggestion < high:
            mid = suggestion
        elif low > 0:
            mid = math.sqrt(low * high)
        else:
            mid = high / 64
        found = probe(mid)
        if found is None:
            low = mid
        else:
            plan, high = found, value(found)
            certify = low > 0 and math.log(high / low) < _CERTIFY
        suggestion = guess(mid, found) if guess is not None else 0.0
        trust = low > 0 and math.log(high / low) <= width / 2 if mid == suggestion else True
    return plan, high


def _finish(
    probe: Callable[[float], P | None],
    value: Callable[[P], float],
    candidates: list[float],
    plan: P,
    high: float,
) -> tuple[P, float]:
    """The smallest feasible value among ``candidates`` (ascending, all below ``high``,
    which is feasible with ``plan``), when no answer changes between them."""
    lo, hi = -1, len(candidates)  # candidates[lo] infeasible, candidates[hi] (or high) not
    if candidates:  # the bisection has most often found the optimum already
        found = probe(candidates[-1])
        if found is None:
            return plan, high
        hi, plan = len(candidates) - 1, found
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = probe(candidates[mid])
        if found is None:
            lo = mid
        else:
            hi, plan = mid, found
    return plan, value(plan) if hi < len(candidates) else high
