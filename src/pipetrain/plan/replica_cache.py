"""Reusing the cost model's ``min_replicas`` answers between the probes of a bisection.

The smallest number of replicas that brings a stage to a time limit ``T`` can only grow as
``T`` shrinks (the set of fast-enough replica counts shrinks). So once two probes at
``T_low < T_high`` gave the same answer for a stage, every probe between them gives it
too. A bisection only probes inside the bracket of its last infeasible and feasible
limits; :class:`ReplicaCache` keeps the answers at both ends of that bracket and asks
the model again only for the stages whose answers still differ, which are fewer with
every step. This is what makes the 40 probes of an exact search cost about as much as a
handful of full ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipetrain.plan.costs import CostModel, LevelContext, StageRow

__all__ = ["ReplicaCache"]


class ReplicaCache:
    """``model.min_replicas`` for every row, reused inside the current bracket.

    Example:
        >>> from pipetrain.plan.costs import StageLoad, StageRow, LevelContext
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> load = StageLoad(compute_s=6.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> cache = ReplicaCache([StageRow.of([load])], PipeDreamCostModel(),
        ...                      LevelContext(bandwidth=1e9), max_replicas=8)
        >>> cache.row(0, 2.0); cache.settle(found=True)
        [3]
        >>> cache.row(0, 1.0); cache.settle(found=False)
        [6]
        >>> cache.row(0, 1.5)
        [4]
    """

    def __init__(
        self,
        rows: Sequence[StageRow],
        model: CostModel,
        level: LevelContext,
        *,
        max_replicas: int,
        at_least: int = 1,
    ) -> None:
        self.rows, self.model, self.level = rows, model, level
        self.max_replicas, self.at_least = max_replicas, at_least
        n = len(rows)
        self._low_limit, self._high_limit = -math.inf, math.inf
        self._low: list[list[int] | None] = [None] * n
        self._high: list[list[int] | None] = [None] * n
        self._unstable: list[list[int] | None] = [None] * n  # None: not known
        self._stale = [False] * n  # the list holds a superset: filter before use
        self._current: list[list[int] | None] = [None] * n  # whole rows asked
        self._partial: list[dict[int, int] | None] = [None] * n  # single entries asked
        self._current_limit = math.nan
        self.fresh_entries = 0
        """How many entries the model was asked about (for benchmarks)."""

    def _ask(
        self, row: StageRow, time_limit: float, indices: list[int] | None = None
    ) -> list[int]:
        self.fresh_entries += len(row) if indices is None else len(indices)
        return self.model.min_replicas(
            row,
            level=self.level,
            time_limit=time_limit,
            max_replicas=self.max_replicas,
            at_least=self.at_least,
            indices=indices,
        )

    def _start(self, time_limit: float) -> None:
        if time_limit != self._current_limit:
            self._current = [None] * len(self.rows)
            self._partial = [None] * len(self.rows)
            self._current_limit = time_limit

    def lower(self, a: int, time_limit: float) -> list[int] | None:
        """Lower bounds of row ``a``'s answers at ``time_limit`` (answers at a limit at
        least as large), or None when there are none close enough to be worth it (within
        25%). A 0 (no replica count fits) stays 0."""
        high = self._high[a]
        if high is None or not time_limit <= self._high_limit <= 1.25 * time_limit:
            return None
        return high

    def exact(self, a: int, time_limit: float, indices: list[int]) -> list[int]:
        """The answers for the entries ``indices`` of row ``a`` at ``time_limit``."""
        self._start(time_limit)
        low, high = self._low[a], self._high[a]
        inside = low is not None and high is not None and self._low_limit < time_limit <= self._high_limit
        answers = [-1] * len(indices)
        ask = []
        for j, k in enumerate(indices):
            if inside and low[k] == high[k]:  # type: ignore[index]
                answers[j] = high[k]  # type: ignore[index]
            else:
                ask.append(j)
        if ask:
            fresh = self._ask(self.rows[a], time_limit, [indices[j] for j in ask])
            for j, r in zip(ask, fresh):
                answers[j] = r
        partial = self._partial[a]
        if partial is None:
            partial = self._partial[a] = {}
        partial.update(zip(indices, answers))
        return answers

    def row(self, a: int, time_limit: float) -> list[int]:
        """The answers for row ``a`` at ``time_limit`` (the current probe's limit)."""
        self._start(time_limit)
        low, high = self._low[a], self._high[a]
        if low is None or high is None or not self._low_limit < time_limit <= self._high_limit:
            result = self._ask(self.rows[a], time_limit)
        else:
            unstable = self._unstable_entries(a, low, high)
            if not unstable:
                result = high
            elif 2 * len(unstable) > len(high):  # most of the row: ask for all of it
                result = self._ask(self.rows[a], time_limit)
            else:
                result = list(high)
                answers = self._ask(self.rows[a], time_limit, unstable)
                for k, r in zip(unstable, answers):
                    result[k] = r
        self._current[a] = result
        return result

    def _unstable_entries(self, a: int, low: list[int], high: list[int]) -> list[int]:
        """The entries of row ``a`` whose answers differ at the two ends."""
        unstable = self._unstable[a]
        if unstable is None:
            unstable = [k for k, (x, y) in enumerate(zip(low, high)) if x != y]
        elif self._stale[a]:
            unstable = [k for k in unstable if low[k] != high[k]]
        self._unstable[a], self._stale[a] = unstable, False
        return unstable

    def events(self, low: float, high: float, *, budget: int) -> set[float] | None:
        """Every stage time in ``(low, high]`` at which an answer inside the current
        bracket can change (the times of the replica counts between the two ends), or
        None when that takes more than ``budget`` model calls or the bracket is not
        ``low..high``."""
        if not (self._low_limit <= low and high <= self._high_limit):
            return None
        found: set[float] = set()
        calls = 0
        for a, row in enumerate(self.rows):
            low_row, high_row = self._low[a], self._high[a]
            if low_row is None or high_row is None:
                return None
            for k in self._unstable_entries(a, low_row, high_row):
                first = high_row[k]
                last = low_row[k] - 1 if low_row[k] else self.max_replicas
                calls += last - first + 1
                if first == 0 or calls > budget:
                    return None
                load = row.load(k)
                for r in range(first, last + 1):
                    t = self.model.stage_time(load, replicas=r, level=self.level)
                    if low < t <= high:
                        found.add(t)
        return found

    def settle(self, *, found: bool) -> None:
        """The probe at the current limit found a plan (``found``: later probes are at or
        below it) or not (later probes are above it).

        Its answers become that end of the bracket: whole rows as they are, single
        entries over the end's previous answers (each entry then holds an answer at a
        limit on the right side of every later probe, which is all reuse needs).
        """
        limit = self._current_limit
        if math.isnan(limit):
            return
        nested = self._low_limit < limit <= self._high_limit
        side = self._high if found else self._low
        for a in range(len(self.rows)):
            whole, partial = self._current[a], self._partial[a]
            if whole is not None:
                side[a] = whole
            elif not nested:
                side[a] = None
            elif partial and side[a] is not None:
                after = list(side[a])  # type: ignore[arg-type]
                for k, r in partial.items():
                    after[k] = r
                side[a] = after
            if self._low[a] is None or self._high[a] is None or not nested:
                self._unstable[a] = None
            elif whole is not None or partial:
                self._stale[a] = True  # entries stable before stay stable: filter later
        if found:
            self._high_limit = limit
        else:
            self._low_limit = limit
        self._current = [None] * len(self.rows)
        self._partial = [None] * len(self.rows)
        self._current_limit = math.nan
