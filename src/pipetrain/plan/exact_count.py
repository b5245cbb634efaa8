"""Probes for plans on *exactly* the given number of workers.

:meth:`~pipetrain.plan.search.FlatSearch.probe_fewest` finds the fewest workers that
meet a time limit; a plan that must use every worker (PipeDream's default, and
``--straight``'s exactly-as-many-stages-as-workers) needs to know which worker counts
the rest of the model can take, not only the fewest. These probes carry, per cut, the
achievable counts as the bits of an integer (bit ``k``: the stages after the cut can use
exactly ``k`` workers), one shift-and-or per pair of cuts.

Example:
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.costs import LevelContext
    >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
    >>> from pipetrain.plan.graph import CutGraph
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=float(k + 1), backward_s=0.0)
    ...                for k in range(4))
    >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
    ...                level=LevelContext(bandwidth=1e9), num_workers=3, straight=True)
    >>> probe_straight_exact(s, 4.0), probe_straight_exact(s, 3.5)
    ([(0, 2, 1), (2, 3, 1), (3, 4, 1)], None)
"""

from __future__ import annotations

from pipetrain.plan.search import EVENT_BUDGET, FlatSearch, Stages

__all__ = [
    "events_exact",
    "events_straight",
    "probe_exact",
    "probe_straight_exact",
    "straight_memory_masks",
]


def probe_straight_exact(search: FlatSearch, time_limit: float) -> Stages | None:
    """A straight plan of exactly ``num_workers`` stages, each at most
    ``time_limit``, or None."""
    g, count = search.graph, search.num_workers
    if count > g.num_nodes:
        return None
    search.effort.charge(search.num_pairs, what="a probe for exactly as many stages as workers")
    search.effort.tick(f"probing a slowest stage of {time_limit:.6g} s")
    keep = (1 << (count + 1)) - 1
    counts = [0] * g.num_cuts  # bit k: the suffix can be cut into exactly k stages
    counts[g.full] = 1
    feasible: list[list[int]] = [[]] * g.num_cuts
    masks = straight_memory_masks(search) if search.memory_limit is not None else None
    for a in range(g.full - 1, -1, -1):
        ends = g.supersets(a)
        ok = search.single.row(a, time_limit)
        bits = 0
        for k, b in enumerate(ends):
            if ok[k]:
                reach = counts[b] if masks is None else counts[b] & masks[a][k]
                bits |= reach << 1
        counts[a] = bits & keep
        feasible[a] = ok
    search.single.settle(found=bool(counts[0] >> count & 1))
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

def probe_exact(search: FlatSearch, time_limit: float) -> Stages | None:
    """A replicated plan on exactly ``num_workers`` workers with every stage at most
    ``time_limit``, or None; needs a model with ``replicas_monotone``.

    Per cut, the achievable worker counts of the rest are the bits of an integer: a
    stage adds 1 (when one replica is fast enough) or any ``r`` from the smallest
    fast-enough ``r >= 2`` on, which (the model being monotone from 2 replicas on)
    reaches every count from ``fewest(rest) + r`` up.
    """
    assert search.model.replicas_monotone, "probe_exact needs replicas_monotone"
    g, count = search.graph, search.num_workers
    search.effort.charge(search.num_pairs, what="a probe for plans on exactly the workers")
    search.effort.tick(f"probing a slowest stage of {time_limit:.6g} s")
    keep = (1 << (count + 1)) - 1
    counts = [0] * g.num_cuts
    counts[g.full] = 1
    ones: list[list[int]] = [[]] * g.num_cuts
    starts: list[list[int]] = [[]] * g.num_cuts  # fewest replicas >= 2, after fewest
    masks = straight_memory_masks(search) if search.memory_limit is not None else None
    for a in range(g.full - 1, -1, -1):
        one = search.single.row(a, time_limit)
        two = list(search.at_least_two.row(a, time_limit))
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
                    r = search.fit_memory(a, k, r, fewest, time_limit, count - fewest)
                    two[k] = r
                if r and fewest + r <= count:
                    bits |= keep ^ ((1 << (fewest + r)) - 1)
        counts[a] = bits & keep
        ones[a], starts[a] = one, two
    found = bool(counts[0] >> count & 1)
    search.single.settle(found=found)
    search.at_least_two.settle(found=found)
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

def straight_memory_masks(search: FlatSearch) -> list[list[int]]:
    """Per stage, the bit mask of stage counts after it that fit the memory limit."""
    limit, count = search.memory_limit, search.num_workers
    assert limit is not None
    if search.straight_masks is None or search.straight_masks[0] != limit:
        masks = []
        for row in search.rows:
            row_masks = []
            for k in range(len(row)):
                load = row.load(k)
                lo, hi = 0, count  # largest d with memory(workers = d + 1) <= limit
                if search.model.stage_memory(load, replicas=1, workers_from_stage=1) > limit:
                    row_masks.append(0)
                    continue
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    mem = search.model.stage_memory(load, replicas=1, workers_from_stage=mid + 1)
                    lo, hi = (mid, hi) if mem <= limit else (lo, mid - 1)
                row_masks.append((1 << (lo + 1)) - 1)
            masks.append(row_masks)
        search.straight_masks = (limit, masks)
    return search.straight_masks[1]



def events_exact(search: FlatSearch, low: float, high: float) -> set[float] | None:
    """As :meth:`~pipetrain.plan.search.FlatSearch.events_fewest`, for :func:`probe_exact`."""
    ones = search.single.events(low, high, budget=EVENT_BUDGET)
    twos = search.at_least_two.events(low, high, budget=EVENT_BUDGET)
    return None if ones is None or twos is None else ones | twos

def events_straight(search: FlatSearch, low: float, high: float) -> set[float] | None:
    """As :meth:`~pipetrain.plan.search.FlatSearch.events_fewest`, for :func:`probe_straight_exact`."""
    return search.single.events(low, high, budget=EVENT_BUDGET)
