"""The search for the largest model that fits: doubling from a start, then bisection.

Pure Python (no torch): ``fits(n)`` is any monotone predicate (``n`` blocks train under
the cap, or not), so the search is tested against a fake one. From ``start`` it doubles
while ``n`` fits (or halves while it does not), which brackets the answer between the
largest size seen to fit and the smallest seen not to; then it bisects the bracket until
it is at most ``max(1, tolerance * largest)`` wide (``tolerance=0``: exact).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Search", "largest_fitting"]


@dataclass(kw_only=True)
class Search:
    """What a search found: ``largest`` fits (0: not even 1 does), ``first_too_large``
    does not (``None``: ``limit`` fits), every ``(n, fits)`` trial in order, and whether
    it finished (``stopped``: why not)."""

    largest: int = 0
    first_too_large: int | None = None
    trials: list[tuple[int, bool]] = field(default_factory=list)
    stopped: str | None = None

    @property
    def complete(self) -> bool:
        """The bracket was narrowed to the tolerance (no time limit, no failed trial)."""
        return self.stopped is None

    def to_dict(self) -> dict[str, Any]:
        return {"largest": self.largest, "first_too_large": self.first_too_large,
                "trials": [list(t) for t in self.trials], "stopped": self.stopped}


def largest_fitting(fits: Callable[[int], bool], *, start: int = 1, limit: int,
                    tolerance: float = 0.0, deadline: float | None = None,
                    stop: Callable[[], str | None] = lambda: None) -> Search:
    """The largest ``n`` in ``1..limit`` with ``fits(n)`` (``fits`` taken to be monotone).

    Doubles from ``start`` while ``n`` fits (halves while it does not), then bisects the
    bracket to ``max(1, tolerance * largest)``. Stops early, with the best found so far
    and the reason, past ``deadline`` (a ``time.monotonic()`` value) or when ``stop()``
    gives a reason (a trial that failed other than by memory).

    Example:
        >>> found = largest_fitting(lambda n: n <= 13, limit=100)
        >>> found.largest, found.first_too_large, [n for n, _ in found.trials]
        (13, 14, [1, 2, 4, 8, 16, 12, 14, 13])
        >>> [n for n, _ in largest_fitting(lambda n: n <= 13, start=40, limit=100).trials]
        [40, 20, 10, 15, 12, 13, 14]
        >>> largest_fitting(lambda n: n <= 130, start=64, limit=1000, tolerance=0.1).largest
        128
    """
    if limit < 1 or start < 1:
        raise ValueError(f"limit={limit} and start={start} must be >= 1")
    found = Search()

    def attempt(n: int) -> bool | None:
        reason = stop()
        if reason is None and deadline is not None and time.monotonic() > deadline:
            reason = "out of time"
        if reason is not None:
            found.stopped = reason
            return None
        ok = fits(n)
        found.trials.append((n, ok))
        if ok:
            found.largest = max(found.largest, n)
        else:
            found.first_too_large = n if found.first_too_large is None \
                else min(found.first_too_large, n)
        return ok

    n = min(start, limit)
    ok = attempt(n)
    if ok is None:
        return found
    if ok:  # double until one does not fit
        while n < limit:
            n = min(2 * n, limit)
            ok = attempt(n)
            if not ok:
                break
    else:  # halve until one fits
        while n > 1:
            n //= 2
            ok = attempt(n)
            if ok is None or ok:
                break
    while found.complete and found.first_too_large is not None:
        low, high = found.largest, found.first_too_large
        if high - low <= max(1, int(tolerance * low)):
            break
        if attempt((low + high) // 2) is None:
            break
    return found
