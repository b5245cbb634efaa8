"""The plain dynamic program over (cut, workers): the reference the fast search is checked against.

``best(cut, m)`` is the smallest bottleneck of the stages after ``cut`` on exactly ``m``
workers (PipeDream's recurrence, run from the end so that every stage knows the workers
after it, which its memory depends on)::

    best(cut, m) = min over cuts b > cut, replicas r <= m of
                   max(stage_time(cut..b, r), best(b, m - r))    [memory(cut..b, r, m) fits]

It costs ``O(pairs of cuts x workers^2)`` model calls, so the planner uses it only where
the threshold search (:mod:`pipetrain.plan.search`) cannot answer alone: plans on exactly
``num_workers`` workers whose fewest-workers optimum cannot be padded, and tests.
"""

from __future__ import annotations

import math

from pipetrain.plan.search import FlatSearch, Stages, replicas_per_stage

__all__ = ["exact_dp"]


def exact_dp(search: FlatSearch, *, fewer_workers: bool = False) -> tuple[Stages, float] | None:
    """The optimal plan of ``search``'s problem on exactly ``num_workers`` workers (at most,
    with ``fewer_workers``), or None when none fits.

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.costs import LevelContext
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> from pipetrain.plan.graph import CutGraph
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=float(k + 1), backward_s=0.0)
        ...                for k in range(3))
        >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
        ...                level=LevelContext(bandwidth=1e9), num_workers=2, straight=True)
        >>> exact_dp(s)
        ([(0, 2, 1), (2, 3, 1)], 3.0)
    """
    g, workers = search.graph, search.num_workers
    model, level, memory = search.model, search.level, search.memory_limit
    top = replicas_per_stage(search)
    inf = math.inf
    search.effort.charge(search.num_pairs * workers * top,
                         what=f"the program over cuts and {workers:,} worker counts")
    best = [[inf] * (workers + 1) for _ in range(g.num_cuts)]
    best[g.full][0] = 0.0
    pick: list[list[tuple[int, int]]] = [[(0, 0)] * (workers + 1) for _ in range(g.num_cuts)]
    for a in range(g.full - 1, -1, -1):
        row, here, choice = search.rows[a], best[a], pick[a]
        search.effort.tick(f"program over worker counts, cut {g.full - a} of {g.full}")
        for k, b in enumerate(g.supersets(a)):
            load = row.load(k)
            times = [0.0] + [
                model.stage_time(load, replicas=r, level=level) for r in range(1, top + 1)
            ]
            rest = best[b]
            for m in range(1, workers + 1):
                for r in range(1, min(m, top) + 1):
                    after = rest[m - r]
                    if after == inf:
                        continue
                    value = max(times[r], after)
                    if value < here[m] and (
                        memory is None
                        or model.stage_memory(load, replicas=r, workers_from_stage=m) <= memory
                    ):
                        here[m], choice[m] = value, (b, r)
    counts = range(1, workers + 1) if fewer_workers else range(workers, workers + 1)
    m = min(counts, key=lambda c: (best[0][c], -c))
    value = best[0][m]
    if value == inf:
        return None
    stages: Stages = []
    a = 0
    while a != g.full:
        b, r = pick[a][m]
        stages.append((a, b, r))
        a, m = b, m - r
    return stages, value
