"""The best plan of every pipeline depth: the smallest slowest stage with exactly K stages.

A pipeline's fill and drain grow with its number of stages ``K``, which the slowest
stage's time does not see; a planner that simulates the step (the ``pipetrain`` cost
model) re-scores the best plan of each depth. :func:`best_per_depth` runs the plain
program over (cut, workers, stages) from the last cut back, as
:mod:`pipetrain.plan.exact_dp` does over (cut, workers)::

    best(cut, m, k) = min over cuts b > cut, replicas r <= m of
                      max(stage_time(cut..b, r), best(b, m - r, k - 1))
                      [memory(cut..b, r, m) fits]

It costs ``O(pairs of cuts x workers^2 x stages)`` model calls: :func:`depth_cost`
says how many, for the caller to decide.

Example:
    >>> from pipetrain.plan.costs import LevelContext
    >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
    >>> from pipetrain.plan.graph import CutGraph
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=float(k + 1), backward_s=0.0)
    ...                for k in range(3))
    >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
    ...                level=LevelContext(bandwidth=1e9), num_workers=2)
    >>> best_per_depth(s)
    {1: ([(0, 3, 2)], 3.0), 2: ([(0, 2, 1), (2, 3, 1)], 3.0)}
"""

from __future__ import annotations

import math

from pipetrain.plan.search import FlatSearch, Stages

__all__ = ["best_per_depth", "depth_cost"]


def depth_cost(search: FlatSearch) -> int:
    """About how many model calls :func:`best_per_depth` makes."""
    g, workers = search.graph, search.num_workers
    pairs = sum(len(g.supersets(a)) for a in range(g.full))
    return pairs * workers * workers * min(workers, g.num_nodes)


def best_per_depth(search: FlatSearch, *, fewer_workers: bool = False) -> dict[int, tuple[Stages, float]]:
    """For every number of stages ``K`` that has a plan, the plan on exactly
    ``num_workers`` workers (at most, with ``fewer_workers``) with the smallest slowest
    stage, and that time; within the memory limit. Straight searches give one worker per
    stage."""
    g, workers = search.graph, search.num_workers
    model, level, memory = search.model, search.level, search.memory_limit
    depth = min(workers, g.num_nodes)
    top = 1 if search.straight else workers
    inf = math.inf
    search.effort.charge(depth_cost(search), what="the program over pipeline depths")
    # best[cut][m][k], pick[cut][m][k] = (next cut, replicas)
    best = [[[inf] * (depth + 1) for _ in range(workers + 1)] for _ in range(g.num_cuts)]
    pick = [[[(0, 0)] * (depth + 1) for _ in range(workers + 1)] for _ in range(g.num_cuts)]
    best[g.full][0][0] = 0.0
    for a in range(g.full - 1, -1, -1):
        row, here, choice = search.rows[a], best[a], pick[a]
        search.effort.tick(f"program over pipeline depths, cut {g.full - a} of {g.full}")
        for k, b in enumerate(g.supersets(a)):
            load = row.load(k)
            times = [0.0] + [model.stage_time(load, replicas=r, level=level)
                             for r in range(1, top + 1)]
            rest = best[b]
            for m in range(1, workers + 1):
                for r in range(1, min(m, top) + 1):
                    after = rest[m - r]
                    fits: bool | None = None
                    for stages in range(1, depth + 1):
                        value = max(times[r], after[stages - 1])
                        if value >= here[m][stages]:
                            continue
                        if fits is None:
                            fits = memory is None or model.stage_memory(
                                load, replicas=r, workers_from_stage=m) <= memory
                        if fits:
                            here[m][stages], choice[m][stages] = value, (b, r)
    counts = range(1, workers + 1) if fewer_workers else range(workers, workers + 1)
    out: dict[int, tuple[Stages, float]] = {}
    for stages in range(1, depth + 1):
        m = min(counts, key=lambda c: (best[0][c][stages], -c))
        value = best[0][m][stages]
        if value == inf:
            continue
        plan: Stages = []
        a, left = 0, stages
        while a != g.full:
            b, r = pick[a][m][left]
            plan.append((a, b, r))
            a, m, left = b, m - r, left - 1
        out[stages] = (plan, value)
    return out
