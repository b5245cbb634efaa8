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
by bisection, and certified exactly: a final probe with "strictly below ``T``" finds
nothing. One probe costs one pass over the pairs of cuts, whatever the number of workers,
which is what makes 1,024 workers cheap.

Straight pipelines (one worker per stage) with exactly ``num_workers`` stages need the
set of achievable stage counts instead of the fewest; a probe then carries, per cut, the
counts as the bits of an integer.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Callable, Sequence

from pipetrain.plan.costs import CostModel, LevelContext, StageLoad, StageRow
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.replica_cache import ReplicaCache

__all__ = ["FlatSearch", "Stages", "minimize"]

Stages = list[tuple[int, int, int]]
"""A plan on one level: ``(first cut, last cut, replicas)`` per stage, in order."""

_REL = 1e-10
_EVENT_BUDGET = 200_000


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
        >>> minimize(s.probe_fewest, s.bottleneck)
        ([(0, 2, 1), (2, 4, 1)], 2.0)
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
    ) -> None:
        self.graph = graph
        self.model = model
        self.level = level
        self.num_workers = num_workers
        self.straight = straight
        self.memory_limit = memory_limit
        self.rows = [self._row(a) for a in range(graph.full)]
        self._memory_masks: tuple[float, list[list[int]]] | None = None
        self._one = ReplicaCache(self.rows, model, level, max_replicas=1)
        self._fewest = (
            self._one if straight else ReplicaCache(self.rows, model, level, max_replicas=num_workers)
        )
        self._two = ReplicaCache(self.rows, model, level, max_replicas=num_workers, at_least=2)
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
        )

    def load(self, a: int, b: int) -> StageLoad:
        """The stage between cuts ``a < b``."""
        g = self.graph
        return StageLoad(
            compute_s=g.stage_sum("compute_s", a, b),
            parameter_bytes=g.stage_sum("parameter_bytes", a, b),
            activation_bytes=g.stage_sum("activation_bytes", a, b),
            input_bytes=g.boundary[a],
            output_bytes=0.0 if b == g.full else g.boundary[b],
            is_first=a == 0,
            is_last=b == g.full,
            weight_memory_bytes=g.stage_sum("weight_memory_bytes", a, b),
            saved_bytes=g.stage_sum("saved_bytes", a, b),
        )

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
        g, limit = self.graph, self.num_workers
        big = 4 * limit + 1  # beyond it: infeasible (up to it: how far, for guess)
        fewest = [big] * g.num_cuts
        fewest[g.full] = 0
        choice: list[tuple[int, int]] = [(0, 0)] * g.num_cuts
        memory, cache = self.memory_limit, self._fewest
        gather, seen, costs = self._gather, self._seen, self._costs
        for a in range(g.full - 1, -1, -1):
            ends = g.supersets(a)
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
            self._two.settle(found=fewest[0] <= limit)
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
        if not (math.isfinite(t1) and math.isfinite(t2)) or n1 == n2 or t1 == t2 or n2 < 1:
            return single
        slope = (math.log(n1) - math.log(n2)) / (math.log(t1) - math.log(t2))
        if slope >= 0:
            return single
        return t2 * (workers / n2) ** (1 / slope)

    def events_fewest(self, low: float, high: float) -> set[float] | None:
        """The limits in ``(low, high]`` where :meth:`probe_fewest` can change its answer
        (None: too many to list, or a memory limit with a model not ``replicas_monotone``).
        """
        fewest = self._fewest.events(low, high, budget=_EVENT_BUDGET)
        if self.memory_limit is None or self.straight or fewest is None:
            return fewest
        if not self.model.replicas_monotone:
            return None
        two = self._two.events(low, high, budget=_EVENT_BUDGET)
        return None if two is None else fewest | two

    def events_exact(self, low: float, high: float) -> set[float] | None:
        """As :meth:`events_fewest`, for :meth:`probe_exact`."""
        ones = self._one.events(low, high, budget=_EVENT_BUDGET)
        twos = self._two.events(low, high, budget=_EVENT_BUDGET)
        return None if ones is None or twos is None else ones | twos

    def events_straight(self, low: float, high: float) -> set[float] | None:
        """As :meth:`events_fewest`, for :meth:`probe_straight_exact`."""
        return self._one.events(low, high, budget=_EVENT_BUDGET)

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
                r = self._fit_memory(a, k, replicas[k], after, time_limit, min(best - 1 - after, limit))
                if r:
                    best, pick = after + r, (ends[k], r)
            return best, pick
        # monotone from 2 replicas: r = max(time's fewest, memory's fewest), where a
        # stage fast on 1 replica but needing more for memory takes time's fewest >= 2
        two = self._two.row(a, time_limit)
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

    def _fit_memory(
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
            for r in range(r + 1, top + 1):
                if fits(r) and model.stage_time(load, replicas=r, level=self.level) <= time_limit:
                    return r
            return 0
        if r == 1:  # from 2 replicas on, time and memory only fall
            r = self._two.row(a, time_limit)[k]
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

    def probe_straight_exact(self, time_limit: float) -> Stages | None:
        """A straight plan of exactly ``num_workers`` stages, each at most
        ``time_limit``, or None."""
        g, count = self.graph, self.num_workers
        if count > g.num_nodes:
            return None
        keep = (1 << (count + 1)) - 1
        counts = [0] * g.num_cuts  # bit k: the suffix can be cut into exactly k stages
        counts[g.full] = 1
        feasible: list[list[int]] = [[]] * g.num_cuts
        masks = self._straight_memory_masks() if self.memory_limit is not None else None
        for a in range(g.full - 1, -1, -1):
            ends = g.supersets(a)
            ok = self._one.row(a, time_limit)
            bits = 0
            for k, b in enumerate(ends):
                if ok[k]:
                    reach = counts[b] if masks is None else counts[b] & masks[a][k]
                    bits |= reach << 1
            counts[a] = bits & keep
            feasible[a] = ok
        self._one.settle(found=bool(counts[0] >> count & 1))
        if not counts[0] >> count & 1:
            return None
        stages: Stages = []
        a, left = 0, count
        while a != g.full:
            for k, b in enumerate(g.supersets(a)):
                reach = counts[b] if masks is None else counts[b] & masks[a][k]
                if feasible[a][k] and reach >> (left - 1) & 1:
                    stages.append((a, b, 1))
                    a, left = b, left - 1
                    break
            else:  # pragma: no cover - the bits above say a stage exists
                raise AssertionError("straight plan reconstruction failed")
        return stages

    def probe_exact(self, time_limit: float) -> Stages | None:
        """A replicated plan on exactly ``num_workers`` workers with every stage at most
        ``time_limit``, or None; needs a model with ``replicas_monotone``.

        Per cut, the achievable worker counts of the rest are the bits of an integer: a
        stage adds 1 (when one replica is fast enough) or any ``r`` from the smallest
        fast-enough ``r >= 2`` on, which (the model being monotone from 2 replicas on)
        reaches every count from ``fewest(rest) + r`` up.
        """
        assert self.model.replicas_monotone, "probe_exact needs replicas_monotone"
        g, count = self.graph, self.num_workers
        keep = (1 << (count + 1)) - 1
        counts = [0] * g.num_cuts
        counts[g.full] = 1
        ones: list[list[int]] = [[]] * g.num_cuts
        starts: list[list[int]] = [[]] * g.num_cuts  # fewest replicas >= 2, after fewest
        masks = self._straight_memory_masks() if self.memory_limit is not None else None
        for a in range(g.full - 1, -1, -1):
            one = self._one.row(a, time_limit)
            two = list(self._two.row(a, time_limit))
            bits = 0
            for k, b in enumerate(g.supersets(a)):
                rest = counts[b]
                if not rest:
                    two[k] = 0
                    continue
                if one[k]:
                    bits |= (rest if masks is None else rest & masks[a][k]) << 1
                r = two[k]
                if r:
                    fewest = (rest & -rest).bit_length() - 1
                    if masks is not None:
                        r = self._fit_memory(a, k, r, fewest, time_limit, count - fewest)
                        two[k] = r
                    if r and fewest + r <= count:
                        bits |= keep ^ ((1 << (fewest + r)) - 1)
            counts[a] = bits & keep
            ones[a], starts[a] = one, two
        found = bool(counts[0] >> count & 1)
        self._one.settle(found=found)
        self._two.settle(found=found)
        if not found:
            return None
        stages: Stages = []
        a, left = 0, count
        while a != g.full:
            for k, b in enumerate(g.supersets(a)):
                rest = counts[b]
                if not rest:
                    continue
                if ones[a][k] and (rest if masks is None else rest & masks[a][k]) >> (left - 1) & 1:
                    stages.append((a, b, 1))
                    a, left = b, left - 1
                    break
                fewest = (rest & -rest).bit_length() - 1
                if starts[a][k] and left >= fewest + starts[a][k]:
                    stages.append((a, b, left - fewest))
                    a, left = b, fewest
                    break
            else:  # pragma: no cover - the bits above say a stage exists
                raise AssertionError("exact plan reconstruction failed")
        return stages

    def _straight_memory_masks(self) -> list[list[int]]:
        """Per stage, the bit mask of stage counts after it that fit the memory limit."""
        limit, count = self.memory_limit, self.num_workers
        assert limit is not None
        if self._memory_masks is None or self._memory_masks[0] != limit:
            masks = []
            for row in self.rows:
                row_masks = []
                for k in range(len(row)):
                    load = row.load(k)
                    lo, hi = 0, count  # largest d with memory(workers = d + 1) <= limit
                    if self.model.stage_memory(load, replicas=1, workers_from_stage=1) > limit:
                        row_masks.append(0)
                        continue
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        mem = self.model.stage_memory(load, replicas=1, workers_from_stage=mid + 1)
                        lo, hi = (mid, hi) if mem <= limit else (lo, mid - 1)
                    row_masks.append((1 << (lo + 1)) - 1)
                masks.append(row_masks)
            self._memory_masks = (limit, masks)
        return self._memory_masks[1]

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


def _gatherer(ends: Sequence[int]) -> Callable[[list[int]], Sequence[int]]:
    """A function taking a list to its items at ``ends``, as fast as Python allows."""
    if isinstance(ends, range) and ends.step == 1:
        start, stop = ends.start, ends.stop
        return lambda values: values[start:stop]
    if len(ends) == 1:
        only = ends[0]
        return lambda values: (values[only],)
    getter = operator.itemgetter(*ends)
    return lambda values: getter(values)  # type: ignore[no-any-return]


def minimize(
    probe: Callable[[float], Stages | None],
    value: Callable[[Stages], float],
    *,
    below: float = 0.0,
    guess: Callable[[float, Stages | None], float] | None = None,
    events: Callable[[float, float], set[float] | None] | None = None,
) -> tuple[Stages, float] | None:
    """The smallest ``value(plan)`` over the plans ``probe(limit)`` can return.

    ``probe(limit)`` must return a plan with ``value <= limit`` whenever one exists, and
    None otherwise; ``below`` is a value known to have no plan strictly under it (0: none
    known), tried first. Bisects on the limit: each plan found lowers the upper end to
    its own value; ``guess(limit, plan)`` may suggest the next limit from what the last
    probe saw (followed while it at least halves the bracket); once the bracket is narrow,
    ``events(low, high)`` may list every value in it where a probe's answer can change,
    and the search finishes by bisecting that list. It ends with a certificate: no plan
    is strictly below the answer. None when ``probe(inf)`` finds nothing.
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
    trust, next_events = True, 1e-4
    while high > 0:
        width = math.log(high / low) if low > 0 else math.inf
        if events is not None and width < next_events:
            next_events = width / 100
            values = events(low, high)
            if values is not None:
                return _finish(probe, value, sorted(v for v in values if v < high), plan, high)
        if low > 0 and high <= low * (1 + _REL):
            below = probe(math.nextafter(high, 0.0))
            if below is None:
                break
            plan, high = below, value(below)
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
        suggestion = guess(mid, found) if guess is not None else 0.0
        trust = low > 0 and math.log(high / low) <= width / 2 if mid == suggestion else True
    return plan, high


def _finish(
    probe: Callable[[float], Stages | None],
    value: Callable[[Stages], float],
    candidates: list[float],
    plan: Stages,
    high: float,
) -> tuple[Stages, float]:
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
