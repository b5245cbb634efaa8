"""``Effort``: how much work a planning run may do, and its progress while it works.

The planner's programs cost, in the worst case, a known number of *steps* (stage
evaluations and inner-loop steps: the pairs of cuts times the worker counts times the
replica counts a program tries). Before a program runs, it asks :meth:`Effort.charge`
for its steps; past ``limit`` in all, :class:`PlanTooLarge` is raised at once, naming
the work, the limit and the fix (``fix``, which the planner sets for what it plans), instead of a run that goes on for minutes or hours.
While a program runs it calls :meth:`Effort.tick`, and every ``every_s`` seconds the
``report`` function (``pipetrain plan`` writes it to stderr) gets one line saying what
the planner is doing and how far it got.

Example:
    >>> lines = []
    >>> clock = iter(range(0, 100, 2)).__next__  # a clock that moves 2 s per reading
    >>> effort = Effort(limit=1000, report=lines.append, every_s=3.0, clock=clock)
    >>> effort.task, effort.fix = "search 1 of 2", "fewer workers"
    >>> effort.charge(600, what="a program")
    >>> effort.tick("cut 3 of 10"); effort.tick("cut 4 of 10")
    >>> lines
    ['4 s: search 1 of 2, cut 4 of 10']
    >>> effort.charge(600, what="another program")
    Traceback (most recent call last):
    ...
    pipetrain.plan.effort.PlanTooLarge: another program needs about 600 steps, and with the 600 done before it that is more than the planner's limit of 1,000 steps; fix: fewer workers
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["DEFAULT_MAX_WORK", "PROGRESS_EVERY_S", "Effort", "PlanTooLarge"]

DEFAULT_MAX_WORK = 200_000_000
"""The steps a planning run may take unless told: about a minute on one CPU core (a step
of the planner's pure-Python programs takes about a quarter of a microsecond)."""


PROGRESS_EVERY_S = 5.0
"""Seconds between progress lines unless told."""


class PlanTooLarge(ValueError):
    """A planning run whose programs would take more steps than its limit (a ValueError:
    the input asks for more than the planner does in bounded time)."""


class Effort:
    """The work done so far against ``limit`` steps (None: no limit), with progress lines
    to ``report`` every ``every_s`` seconds (None: :data:`PROGRESS_EVERY_S`; see the module
    docstring).

    Example:
        >>> effort = Effort(limit=None)
        >>> effort.charge(10**12, what="a huge program"); effort.spent
        1000000000000
    """

    def __init__(
        self,
        *,
        limit: int | None,
        report: Callable[[str], None] | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.report = report
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.spent = 0
        self.task = ""
        """What the planner is doing (set by the planner between its searches)."""
        self.fix = "plan for fewer workers or a smaller profile"
        """How to plan with less work, in the planner's terms (set by the planner)."""
        self._start = clock()
        self._last = self._start

    def charge(self, steps: int, *, what: str) -> None:
        """Count ``steps`` about to be taken by ``what``; PlanTooLarge (naming
        :attr:`fix`) when they would pass the limit."""
        if self.limit is not None and self.spent + steps > self.limit:
            before = f", and with the {self.spent:,} done before it that is" if self.spent \
                else ","
            raise PlanTooLarge(
                f"{what} needs about {steps:,} steps{before} more than the planner's limit "
                f"of {self.limit:,} steps; fix: {self.fix}"
            )
        self.spent += steps

    def tick(self, detail: str = "") -> None:
        """Report progress if ``every_s`` seconds passed since the last line."""
        if self.report is None:
            return
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        what = ", ".join(part for part in (self.task, detail) if part) or "planning"
        self.report(f"{now - self._start:.0f} s: {what}")
