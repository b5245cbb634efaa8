"""Plans for hierarchical topologies, level by level, as PipeDream's hierarchical optimizer defines them.

With levels innermost first (say 4 GPUs per server, then 4 servers), PipeDream plans
bottom up. At the innermost level it finds, for *every* segment of the model (every pair
of cuts ``a < b``), the best pipeline of that segment on one server's GPUs, with
replicated stages; that pipeline's time becomes the segment's compute time one level up,
where a stage is a segment run by whole servers (each running the inner pipeline),
replicated over ``r`` servers at the outer bandwidth. The outermost level plans the whole
model. Within a level, the first stage of a segment pays no transfer terms (its input
crosses at the level above), as in PipeDream's code.

Every level is the dynamic program of :mod:`pipetrain.plan.exact_dp` run forwards from
the segment's first cut, over all the cuts of :class:`~pipetrain.plan.graph.CutGraph`
(PipeDream runs it over the antichain states it reaches, a subset), so its optimum is
never worse than PipeDream's. A flattened stage runs on ``r_1 x r_2 x ...`` workers.

Example:
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
    >>> from pipetrain.plan.graph import CutGraph
    >>> from pipetrain.plan.topology import Topology
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=0.0,
    ...                             parameter_bytes=10**9) for k in range(4))
    >>> result = solve_hierarchy(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
    ...                          topology=Topology.from_lists([2, 2], [1e9, 1e9]))
    >>> result.time, [(s.first_cut, s.last_cut, s.replicas_per_level) for s in result.stages]
    (1.0, [(0, 1, (1, 1)), (1, 2, (1, 1)), (2, 3, (1, 1)), (3, 4, (1, 1))])
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipetrain.plan.costs import CostModel, LevelContext, StageLoad
from pipetrain.plan.effort import Effort
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.topology import Topology

__all__ = ["HierarchyResult", "HierarchyStage", "solve_hierarchy"]

_INF = math.inf


@dataclass(frozen=True, kw_only=True)
class HierarchyStage:
    """One innermost stage of a hierarchical plan."""

    first_cut: int
    last_cut: int
    replicas_per_level: tuple[int, ...]
    """Replicas at each level, innermost first."""
    outer_stage: tuple[int, ...]
    """The index of the enclosing stage at each outer level (levels 1, 2, ...)."""
    time: float
    """The innermost stage's time (its level-0 stage time)."""


@dataclass(frozen=True, kw_only=True)
class HierarchyResult:
    time: float
    stages: tuple[HierarchyStage, ...]


class _Levels:
    def __init__(
        self, graph: CutGraph, model: CostModel, topology: Topology, straight: bool, fewer: bool,
        effort: Effort,
    ) -> None:
        self.g, self.model, self.straight, self.fewer = graph, model, straight, fewer
        self.effort = effort
        self.levels = topology.levels
        self.contexts = [
            LevelContext(
                bandwidth=lv.bandwidth,
                workers_per_unit=1 if k == 0 else self.levels[k - 1].num_workers,
                level_index=k,
            )
            for k, lv in enumerate(self.levels)
        ]
        # segment times one level down: inner[(a, b)] (level 0 uses the compute sums)
        self.inner: dict[tuple[int, int], float] = {}

    def load(self, level: int, a: int, b: int, first: bool) -> StageLoad | None:
        """The stage ``a..b`` at ``level``: at level 0 its nodes' compute, above it the
        segment's best inner pipeline (None: there is none)."""
        g = self.g
        compute = g.stage_sum("compute_s", a, b) if level == 0 else self.inner[(a, b)]
        if compute == _INF:
            return None
        return dataclasses.replace(g.load(a, b), compute_s=compute, is_first=first)

    def times(self, level: int, a: int, b: int, first: bool) -> list[float]:
        """Index r: the stage's time with r replicas (index 0 unused)."""
        units = 1 if self.straight else self.levels[level].num_workers
        load = self.load(level, a, b, first)
        if load is None:
            return [_INF] * (units + 1)
        context = self.contexts[level]
        return [_INF] + [
            self.model.stage_time(load, replicas=r, level=context) for r in range(1, units + 1)
        ]

    def segment(
        self, level: int, a: int, later: dict[tuple[int, int], list[float]], *, track: bool
    ) -> tuple[dict[int, list[float]], dict[tuple[int, int], tuple[int, int]]]:
        """Best pipelines from cut ``a`` to every cut ``b > a`` on ``m`` units (index m).

        ``later`` holds the non-first stage times of this level. With ``track``, also the
        back-pointers: ``(b, m) -> (k, r)`` (k = -1: one stage; r = 0: from ``m - 1``).
        """
        g, n = self.g, self.levels[level].num_workers
        ends = g.supersets(a)
        best: dict[int, list[float]] = {}
        back: dict[tuple[int, int], tuple[int, int]] = {}
        for b in ends:
            first = self.times(level, a, b, True)
            row = [_INF] * (n + 1)
            for m in range(1, len(first)):
                row[m] = first[m]
                if track:
                    back[(b, m)] = (-1, m)
            best[b] = row
        top = 1 if self.straight else n - 1
        for k in ends:
            here = best[k]
            if self.fewer:
                for m in range(2, n + 1):
                    if here[m - 1] < here[m]:
                        here[m] = here[m - 1]
                        if track:
                            back[(k, m)] = (k, 0)
            for b in g.supersets(k):
                stage = later[(k, b)]
                there = best[b]
                for r in range(1, min(top, n - 1) + 1):
                    t = stage[r]
                    if t == _INF:
                        continue
                    for m in range(r + 1, n + 1):
                        v = here[m - r]
                        if t > v:
                            v = t
                        if v < there[m]:
                            there[m] = v
                            if track:
                                back[(b, m)] = (k, r)
        return best, back

    def later_times(self, level: int, starts: range | list[int]) -> dict[tuple[int, int], list[float]]:
        return {
            (k, b): self.times(level, k, b, False)
            for k in starts
            for b in self.g.supersets(k)
        }

    def cost(self) -> int:
        """About how many steps (:mod:`pipetrain.plan.effort`) :meth:`solve` takes: per
        level below the top, every chain of three cuts times the worker counts times the
        replica counts (every pair of cuts at the top), at an eighth of a step each (the
        inner loop is that much lighter than a step)."""
        g = self.g
        pairs = sum(len(g.supersets(a)) for a in range(g.full))
        chains = sum(len(g.supersets(k)) for a in range(g.full) for k in g.supersets(a))
        steps = 0
        for level, lv in enumerate(self.levels):
            n = lv.num_workers
            per = n if self.straight else n * n // 2 + n
            steps += pairs * n + (chains if level < len(self.levels) - 1 else pairs) * per
        return steps // 8

    def solve(self) -> HierarchyResult | None:
        g, top = self.g, len(self.levels) - 1
        self.effort.charge(self.cost(), what=f"the hierarchical program over {g.num_cuts:,} "
                                             f"cuts and {len(self.levels)} levels")
        for level in range(top):
            later = self.later_times(level, range(g.num_cuts))
            n = self.levels[level].num_workers
            inner: dict[tuple[int, int], float] = {}
            for a in range(g.full):
                self.effort.tick(f"level {level + 1} of {top + 1}, cut {a + 1} of {g.full}")
                best, _ = self.segment(level, a, later, track=False)
                for b, row in best.items():
                    inner[(a, b)] = row[n]
            self.inner = inner
        later = self.later_times(top, range(g.num_cuts))
        best, back = self.segment(top, 0, later, track=True)
        n = self.levels[top].num_workers
        time = best[g.full][n]
        if time == _INF:
            return None
        stages: list[HierarchyStage] = []
        self._unfold(top, 0, g.full, n, back, (), (), stages)
        return HierarchyResult(time=time, stages=tuple(stages))

    def _unfold(
        self,
        level: int,
        a: int,
        b: int,
        units: int,
        back: dict[tuple[int, int], tuple[int, int]],
        replicas_above: tuple[int, ...],
        outer_above: tuple[int, ...],
        out: list[HierarchyStage],
    ) -> None:
        """Walk the back-pointers of the segment ``a..b`` at ``level`` and recurse."""
        pieces: list[tuple[int, int, int]] = []
        end, m = b, units
        while True:
            k, r = back[(end, m)]
            if k == -1:
                pieces.append((a, end, r))
                break
            if r == 0:
                m -= 1
                continue
            pieces.append((k, end, r))
            end, m = k, m - r
        pieces.reverse()
        for index, (start, stop, r) in enumerate(pieces):
            replicas = (r, *replicas_above)
            outer = (index, *outer_above) if level > 0 else outer_above
            if level == 0:
                first = index == 0
                time = self.times(0, start, stop, first)[r]
                out.append(
                    HierarchyStage(
                        first_cut=start,
                        last_cut=stop,
                        replicas_per_level=replicas,
                        outer_stage=outer,
                        time=time,
                    )
                )
                continue
            below = level - 1
            self.inner = {}  # recomputed for this segment only
            self._inner_for(below, start)
            later = self.later_times(below, [start, *self.g.supersets(start)])
            _, inner_back = self.segment(below, start, later, track=True)
            self._unfold(
                below, start, stop, self.levels[below].num_workers, inner_back,
                replicas, outer, out,
            )

    def _inner_for(self, level: int, start: int) -> None:
        """Recompute the segment times of ``level - 1`` the segments from ``start`` need."""
        if level == 0:
            return
        self._inner_for(level - 1, start)
        g = self.g
        starts = [start, *g.supersets(start)]
        later = self.later_times(level - 1, starts)
        n = self.levels[level - 1].num_workers
        inner: dict[tuple[int, int], float] = {}
        for a in starts:
            if a == g.full:
                continue
            best, _ = self.segment(level - 1, a, later, track=False)
            for b, row in best.items():
                inner[(a, b)] = row[n]
        self.inner = inner


def solve_hierarchy(
    graph: CutGraph,
    *,
    model: CostModel,
    topology: Topology,
    straight: bool = False,
    fewer_workers: bool = False,
    effort: Effort | None = None,
) -> HierarchyResult | None:
    """The best plan over ``topology``'s levels (see the module docstring), or None when no
    plan exists (a straight pipeline longer than the model). ``effort`` bounds the work
    (:mod:`pipetrain.plan.effort`; None: no limit).

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=8.0, backward_s=0.0),))
        >>> solve_hierarchy(CutGraph(one), model=PipeDreamCostModel(),
        ...                 topology=Topology.from_lists([2, 2], [1e9, 1e9])).time
        2.0
    """
    levels = _Levels(graph, model, topology, straight, fewer_workers,
                     effort if effort is not None else Effort(limit=None))
    return levels.solve()
