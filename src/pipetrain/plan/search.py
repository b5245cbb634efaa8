"""The exact search on one topology level: the smallest bottleneck, by threshold probes.

A plan's time is its slowest stage's time ``T``. For a threshold ``T``, one *probe*
finds, by dynamic programming over the cuts (:mod:`pipetrain.plan.graph`) from the last
cut back to the empty one, the fewest workers that finish every suffix of the model with
every stage at most ``T``::

    workers(cut) = min over cuts b > cut of  r(cut, b) + workers(b)

where ``r(cut, b)`` is the fewest replicas that bring the stage ``b - cut`` to ``T``
(the cost model's ``min_replicas``) and, under a memory limit, that also fit it given
the ``workers(b)`` workers after it. Taking the fewest workers after a stage is never
worse: a stage's memory only grows with the workers after it. ``T`` is feasible when
``workers(empty cut) <= num_workers``; the optimum is the smallest feasible ``T``, found
by :func:`~pipetrain.plan.bisection.minimize` and certified exactly. One probe costs one
pass over the pairs of cuts, whatever the number of workers, which is what makes 1,024
workers cheap; the cost model's answers are kept between probes
(:mod:`pipetrain.plan.replica_cache`), so later probes cost less. Plans on *exactly*
``num_workers`` workers are :mod:`pipetrain.plan.exact_count`'s.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Callable, Sequence

from pipetrain.plan.costs import CostModel, LevelContext, StageLoad, StageRow, replica_cap
from pipetrain.plan.effort import Effort
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.replica_cache import ReplicaCache

__all__ = ["EVENT_BUDGET", "FlatSearch", "Stages", "replicas_per_stage"]

Stages = list[tuple[int, int, int]]
"""A plan on one level: ``(first cut, last cut, replicas)`` per stage, in order."""

EVENT_BUDGET = 200_000
"""The most stage times :meth:`FlatSearch.events_fewest` evaluates before giving up."""


class FlatSearch:
    """Probes for one level of ``num_workers`` workers (see the module docstring).

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.costs import LevelContext
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=0.0)
        ...                for k in range(4))
        >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
        ...                level=LevelContext(bandwidth=1e9), num_workers=2)
        >>> s.probe_fewest(2.0), s.probe_fewest(1.5)
        ([(0, 2, 1), (2, 4, 1)], None)
    """

    def __init__(
        self,
        graph: CutGraph,
        *,
        model: CostModel,
        level: LevelContext,
        num_workers: int,
        straight: bool = False,
        memory_limit: float | None = None,
        effort: Effort | None = None,
    ) -> None:
        self.graph = graph
        self.effort = effort if effort is not None else Effort(limit=None)
        """The planning run's work budget and progress reports (shared by its searches)."""
        self.model = model
        self.level = level
        self.num_workers = num_workers
        self.straight = straight
        self.memory_limit = memory_limit
        self.rows = [self._row(a) for a in range(graph.full)]
        self.num_pairs = sum(len(row) for row in self.rows)
        """Candidate stages: the pairs of cuts ``a < b``."""
        self.straight_masks: tuple[float, list[list[int]]] | None = None
        self.single = ReplicaCache(self.rows, model, level, max_replicas=1)
        self.fewest = (
            self.single if straight else ReplicaCache(self.rows, model, level, max_replicas=num_workers)
        )
        self.at_least_two = ReplicaCache(self.rows, model, level, max_replicas=num_workers, at_least=2)
        self._need = 0
        self._feasible: tuple[float, int] | None = None
        self._infeasible: tuple[float, int] | None = None
        # probe_fewest's inner loop, in C: each row's ends' values in one call
        self._gather = [_gatherer(graph.supersets(a)) for a in range(graph.full)]
        self._seen: list[list[int] | None] = [None] * graph.full
        self._costs: list[list[int]] = [[] for _ in range(graph.full)]
        self._memory_memo: list[dict[int, tuple[int, int]]] = [{} for _ in range(graph.full)]
        self._memo_limit = memory_limit

    # -- stages ------------------------------------------------------------------------------
    def _row(self, a: int) -> StageRow:
        g = self.graph
        ends = g.supersets(a)
        full = g.full

        def column(name: str) -> array[float]:
            values = g.sums[name]
            base = values[a]
            return array("d", [values[b] - base for b in ends])

        return StageRow(
            compute_s=column("compute_s"),
            parameter_bytes=column("parameter_bytes"),
            activation_bytes=column("activation_bytes"),
            output_bytes=array("d", [0.0 if b == full else g.boundary[b] for b in ends]),
            is_last=[b == full for b in ends],
            input_bytes=g.boundary[a],
            is_first=a == 0,
            weight_memory_bytes=column("weight_memory_bytes"),
            saved_bytes=column("saved_bytes"),
            forward_s=column("forward_s"),
            backward_input_s=column("backward_input_s"),
            backward_weight_s=column("backward_weight_s"),
            gradient_bytes=column("gradient_bytes"),
            optimizer_step_s=column("optimizer_step_s"),
            workspace_bytes=g.max_column("workspace_bytes", a, ends),
            input_workspace_bytes=g.max_column("input_workspace_bytes", a, ends),
            layer_saved_bytes=g.max_column("layer_saved_bytes", a, ends),
        )

    def load(self, a: int, b: int) -> StageLoad:
        """The stage between cuts ``a < b``."""
        return self.graph.load(a, b)

    def stage_time(self, a: int, b: int, r: int) -> float:
        return self.model.stage_time(self.load(a, b), replicas=r, level=self.level)

    def stage_memory(self, a: int, b: int, r: int, workers_from_stage: int) -> float:
        return self.model.stage_memory(
            self.load(a, b), replicas=r, workers_from_stage=workers_from_stage
        )

    def bottleneck(self, stages: Stages) -> float:
        """The plan's time: its slowest stage's."""
        return max(self.stage_time(a, b, r) for a, b, r in stages)

    def peak_memory(self, stages: Stages) -> float:
        """The plan's largest memory per worker."""
        after = sum(r for _, _, r in stages)
        peak = 0.0
        for a, b, r in stages:
            peak = max(peak, self.stage_memory(a, b, r, after))
            after -= r
        return peak

    def fits(self, stages: Stages, time_limit: float) -> bool:
        """Whether every stage meets ``time_limit`` and the memory limit."""
        if self.memory_limit is not None and self.peak_memory(stages) > self.memory_limit:
            return False
        return all(self.stage_time(a, b, r) <= time_limit for a, b, r in stages)

    # -- probes ------------------------------------------------------------------------------
    def probe_fewest(self, time_limit: float) -> Stages | None:
        """A plan with every stage at most ``time_limit`` on the fewest workers (one each
        when straight), or None when it needs more than ``num_workers``."""
        self.effort.charge(self.num_pairs, what="a probe of the threshold search")
        self.effort.tick(f"probing a slowest stage of {time_limit:.6g} s")
        g, limit = self.graph, self.num_workers
        big = 4 * limit + 1  # beyond it: infeasible (up to it: how far, for guess)
        fewest = [big] * g.num_cuts
        fewest[g.full] = 0
        choice: list[tuple[int, int]] = [(0, 0)] * g.num_cuts
        memory, cache = self.memory_limit, self.fewest
        gather, seen, costs = self._gather, self._seen, self._costs
        for a in range(g.full - 1, -1, -1):
            ends = g.supersets(a)
            if memory is None:
                bounds = cache.lower(a, time_limit)
                if bounds is not None:  # answers at a larger limit: exact ones only
                    found = self._best_by_bounds(a, bounds, fewest, time_limit, big)
                    if found is not None:
                        fewest[a], choice[a] = found
                    continue
            replicas = cache.row(a, time_limit)
            if replicas is not seen[a]:  # answers changed: 0 (none) counts as too many
                seen[a], costs[a] = replicas, [r or big for r in replicas]
            totals = list(map(operator.add, costs[a], gather[a](fewest)))
            best = min(totals)
            if best >= big:
                continue
            if memory is None:
                k = totals.index(best)
                fewest[a], choice[a] = best, (ends[k], replicas[k])
                continue
            # Under a memory limit the totals are lower bounds: fit the stages in their
            # order until the next bound cannot beat the best fit.
            best, pick = self._fit_row(a, replicas, totals, fewest, time_limit, big)
            if best < big:
                fewest[a], choice[a] = best, pick
        cache.settle(found=fewest[0] <= limit)
        if memory is not None and not self.straight and self.model.replicas_monotone:
            self.at_least_two.settle(found=fewest[0] <= limit)
        self._need = fewest[0]
        if fewest[0] > limit:
            return None
        stages: Stages = []
        a = 0
        while a != g.full:
            b, r = choice[a]
            stages.append((a, b, r))
            a = b
        return stages

    def _best_by_bounds(
        self, a: int, bounds: list[int], fewest: list[int], time_limit: float, big: int
    ) -> tuple[int, tuple[int, int]] | None:
        """Row ``a``'s fewest workers when ``bounds`` bound its answers from below: the
        model is asked only about the stages whose bound could still win."""
        if bounds is not self._seen[a]:
            self._seen[a], self._costs[a] = bounds, [r or big for r in bounds]
        totals = list(map(operator.add, self._costs[a], self._gather[a](fewest)))
        floor = min(totals)
        if floor >= big:
            return None
        ends, cache = self.graph.supersets(a), self.fewest
        best, pick = big, (0, 0)
        value = floor  # ask about the stages by bound, one bound value at a time
        while value < best:
            candidates = _positions(totals, value)
            for k, r in zip(candidates, cache.exact(a, time_limit, candidates)):
                total = r + fewest[ends[k]] if r else big
                if total < best or (total == best and k < pick[0]):
                    best, pick = total, (k, r)
            value += 1
        if best >= big:
            return None
        return best, (ends[pick[0]], pick[1])

    def guess(self, time_limit: float, plan: Stages | None) -> float:
        """Where the last :meth:`probe_fewest` calls suggest the optimum lies: workers
        needed against the limit, interpolated on a log-log line through the last probe
        on each side (a stage's time falls about as ``1 / replicas``), or the last
        probe's limit (its plan's time) scaled by the workers it needed over those there
        are."""
        base = self.bottleneck(plan) if plan is not None else time_limit
        need, workers = self._need, self.num_workers
        point = (base, need)
        if plan is None:
            self._infeasible = point if need <= 4 * workers else None
        else:
            self._feasible = point
        single = base * need / workers
        if self._infeasible is None or self._feasible is None:
            return single
        (t1, n1), (t2, n2) = self._infeasible, self._feasible
        if not (math.isfinite(t1) and math.isfinite(t2) and t1 > 0 and t2 > 0) or n2 < 1:
            return single
        run = math.log(t1) - math.log(t2)
        if run == 0 or n1 == n2:
            return single
        slope = (math.log(n1) - math.log(n2)) / run
        if slope >= 0:
            return single
        estimate: float = t2 * (workers / n2) ** (1 / slope)
        return estimate

    def events_fewest(self, low: float, high: float) -> set[float] | None:
        """The limits in ``(low, high]`` where :meth:`probe_fewest` can change its answer
        (None: too many to list, or a memory limit with a model not ``replicas_monotone``).
        """
        fewest = self.fewest.events(low, high, budget=EVENT_BUDGET)
        if self.memory_limit is None or self.straight or fewest is None:
            return fewest
        if not self.model.replicas_monotone:
            return None
        two = self.at_least_two.events(low, high, budget=EVENT_BUDGET)
        return None if two is None else fewest | two

    def _fit_row(
        self,
        a: int,
        replicas: list[int],
        totals: list[int],
        fewest: list[int],
        time_limit: float,
        big: int,
    ) -> tuple[int, tuple[int, int]]:
        """The fewest workers for the rest from cut ``a`` under the memory limit, and the
        stage that starts it; ``totals`` are the bounds without the limit."""
        assert self.memory_limit is not None
        ends, limit, model = self.graph.supersets(a), self.num_workers, self.model
        order = sorted(range(len(totals)), key=totals.__getitem__)
        best, pick = big, (0, 0)
        if not model.replicas_monotone or self.straight:
            for k in order:
                if totals[k] >= best:
                    break
                after = fewest[ends[k]]
                r = self.fit_memory(a, k, replicas[k], after, time_limit, min(best - 1 - after, limit))
                if r:
                    best, pick = after + r, (ends[k], r)
            return best, pick
        # monotone from 2 replicas: r = max(time's fewest, memory's fewest), where a
        # stage fast on 1 replica but needing more for memory takes time's fewest >= 2
        two = self.at_least_two.row(a, time_limit)
        if self._memo_limit != self.memory_limit:  # the memos hold answers for one limit
            self._memory_memo = [{} for _ in self._memory_memo]
            self._memo_limit = self.memory_limit
        memo = self._memory_memo[a]  # k -> (workers after, memory's fewest replicas)
        for start in range(0, len(order), 64):
            chunk = [k for k in order[start : start + 64] if totals[k] < best]
            if not chunk:
                break
            afters = [fewest[ends[k]] for k in chunk]
            missing = [j for j, (k, after) in enumerate(zip(chunk, afters)) if memo.get(k, (-1,))[0] != after]
            if missing:
                answers = model.memory_replicas(
                    self.rows[a], memory_limit=self.memory_limit,
                    workers_after=[afters[j] for j in missing], max_replicas=limit,
                    indices=[chunk[j] for j in missing],
                )
                for j, m in zip(missing, answers):
                    memo[chunk[j]] = (afters[j], m)
            memory = [memo[k][1] for k in chunk]
            for k, after, m in zip(chunk, afters, memory):
                r = replicas[k]
                if m > r:
                    r = max(two[k], m) if r == 1 and two[k] else (m if r > 1 else 0)
                if m and r and r <= limit and after + r < best:
                    best, pick = after + r, (ends[k], r)
        return best, pick

    def fit_memory(
        self, a: int, k: int, r: int, after: int, time_limit: float, max_replicas: int
    ) -> int:
        """The fewest replicas from ``r`` (fast enough) up to ``max_replicas`` that fit the
        memory limit with ``after`` workers after the stage and stay fast enough; 0: none.
        """
        limit = self.memory_limit
        assert limit is not None
        model, load = self.model, self.rows[a].load(k)

        def fits(replicas: int) -> bool:
            used = model.stage_memory(load, replicas=replicas, workers_from_stage=after + replicas)
            return used <= limit

        top = min(1, max_replicas) if self.straight else max_replicas
        if r > top:
            return 0
        if fits(r):
            return r
        if self.straight:
            return 0
        if not model.replicas_monotone:
            for more in range(r + 1, top + 1):
                if fits(more) and model.stage_time(load, replicas=more, level=self.level) <= time_limit:
                    return more
            return 0
        if r == 1:  # from 2 replicas on, time and memory only fall
            r = self.at_least_two.row(a, time_limit)[k]
            if not r or r > top:
                return 0
            if fits(r):
                return r
        if not fits(top):
            return 0
        low, high = r, top  # fits(low) is false, fits(high) true
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid, high)
        return high

    def pad(self, stages: Stages, time_limit: float) -> Stages | None:
        """``stages`` with the unused workers added to one stage, if some stage can take
        them all without passing ``time_limit`` or the memory limit."""
        spare = self.num_workers - sum(r for _, _, r in stages)
        if spare == 0:
            return stages
        for j in range(len(stages)):
            a, b, r = stages[j]
            padded = [*stages[:j], (a, b, r + spare), *stages[j + 1 :]]
            if self.fits(padded, time_limit):
                return padded
        return None


def replicas_per_stage(search: FlatSearch) -> int:
    """The most replicas one stage of the search's plans can have: 1 when straight, else
    the workers, or the model's :func:`~pipetrain.plan.costs.replica_cap` if smaller.

    Example:
        >>> from pipetrain.plan.costs_pipetrain import Candidate, PipetrainCostModel
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=1.0),))
        >>> s = FlatSearch(CutGraph(one), model=PipetrainCostModel(Candidate(num_microbatches=4)),
        ...                level=LevelContext(bandwidth=1e9), num_workers=16)
        >>> replicas_per_stage(s)
        4
    """
    if search.straight:
        return 1
    cap = replica_cap(search.model)
    return search.num_workers if cap is None else max(0, min(search.num_workers, cap))


def _positions(values: list[int], value: int) -> list[int]:
    """Where ``value`` occurs in ``values`` (scanned in C by ``list.index``)."""
    found = []
    start = 0
    try:
        while True:
            start = values.index(value, start)
            found.append(start)
            start += 1
    except ValueError:
        return found


def _gatherer(ends: Sequence[int]) -> Callable[[list[int]], Sequence[int]]:
    """A function taking a list to its items at ``ends``, as fast as Python allows."""
    if isinstance(ends, range) and ends.step == 1:
        start, stop = ends.start, ends.stop
        return lambda values: values[start:stop]
    if len(ends) == 1:
        only = ends[0]
        return lambda values: (values[only],)
    getter = operator.itemgetter(*ends)
    return lambda values: getter(values)
