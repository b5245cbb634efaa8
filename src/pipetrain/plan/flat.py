"""Solving one topology level: the optimum of a search, any plan within memory, and the
smallest memory limit any plan fits.

These drive a :class:`~pipetrain.plan.search.FlatSearch` for whatever cost model it
holds; the planner (:mod:`pipetrain.plan.optimizer`) and the schedule-choosing planner
of the ``pipetrain`` cost model (:mod:`pipetrain.plan.schedule_choice`) both use them.

Example:
    >>> from pipetrain.plan.costs import LevelContext
    >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
    >>> from pipetrain.plan.graph import CutGraph
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=0.0)
    ...                for k in range(4))
    >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
    ...                level=LevelContext(bandwidth=1e9), num_workers=2, straight=True)
    >>> solve_flat(s, fewer_workers=False)
    ([(0, 2, 1), (2, 4, 1)], 2.0)
"""

from __future__ import annotations

import logging
import math
from functools import partial

from pipetrain.plan.bisection import minimize
from pipetrain.plan.exact_count import (
    events_exact,
    events_straight,
    probe_exact,
    probe_straight_exact,
)
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.search import FlatSearch, Stages
from pipetrain.plan.straight import solve_straight

__all__ = [
    "feasible_plan",
    "memory_advice",
    "smallest_memory",
    "solve_flat",
    "straight_advice",
    "straight_stages_needed",
]

logger = logging.getLogger(__name__)


def solve_flat(search: FlatSearch, *, fewer_workers: bool) -> tuple[Stages, float] | None:
    """The optimum on one level; the fewest-workers optimum first, a lower bound of the
    optimum on exactly ``num_workers`` workers and most often equal to it. None: no plan
    fits the memory limit. A straight pipeline of a layer sequence whose stage times are
    sums of layer costs is the plain min-max partition, left to its one solver
    (:mod:`pipetrain.plan.straight`)."""
    if not fewer_workers and (plain := solve_straight(search)) is not None:
        return plain
    fewest = minimize(
        search.probe_fewest, search.bottleneck, guess=search.guess, events=search.events_fewest
    )
    if fewest is None:
        return None
    stages, time = fewest
    if fewer_workers:
        padded = None if search.straight else search.pad(stages, time)
        return (padded, time) if padded is not None else fewest
    if search.straight:
        return minimize(
            partial(probe_straight_exact, search), search.bottleneck, below=time,
            events=partial(events_straight, search),
        )
    padded = search.pad(stages, time)
    if padded is not None:
        return padded, time
    if search.model.replicas_monotone:
        return minimize(
            partial(probe_exact, search), search.bottleneck, below=time,
            events=partial(events_exact, search),
        )
    logger.info(
        "the fewest-workers optimum (%d of %d workers) cannot take the rest; running the "
        "full program over cuts and workers",
        sum(r for _, _, r in stages),
        search.num_workers,
    )
    return exact_dp(search)


def feasible_plan(search: FlatSearch, *, fewer_workers: bool) -> Stages | None:
    """Any plan within the memory limit (time ignored), in the search's mode."""
    if search.straight and not fewer_workers:
        return probe_straight_exact(search, math.inf)
    stages = search.probe_fewest(math.inf)
    if stages is None or fewer_workers:
        return stages
    padded = search.pad(stages, math.inf)
    if padded is not None:
        return padded
    if search.model.replicas_monotone:
        return probe_exact(search, math.inf)
    result = exact_dp(search)
    return None if result is None else result[0]


def smallest_memory(search: FlatSearch, *, fewer_workers: bool) -> float | None:
    """The smallest memory limit some plan of ``search`` (its model, workers and mode,
    its own memory limit ignored and left unset) fits in; None: no plan at all."""
    search.memory_limit = None

    def probe(memory: float) -> Stages | None:
        search.memory_limit = None if memory == math.inf else memory
        return feasible_plan(search, fewer_workers=fewer_workers)

    try:
        smallest = minimize(probe, search.peak_memory)
    finally:
        search.memory_limit = None
    return None if smallest is None else smallest[1]


def straight_stages_needed(search: FlatSearch) -> int | None:
    """The fewest stages, one worker each, that a straight pipeline within the search's
    memory limit needs, however many workers there are (None: no straight pipeline fits,
    even with one node per stage). ``search`` must be straight, on as many workers as
    the graph has nodes."""
    stages = search.probe_fewest(math.inf)
    return None if stages is None else len(stages)


def straight_advice(limit: float, workers: int, needed: int | None) -> str:
    """The message for a straight pipeline whose memory limit needs ``needed`` stages
    (None: more than there are nodes) on ``workers`` workers.

    Example:
        >>> straight_advice(4e9, 2, 3).endswith("give --workers 3, raise --memory, or drop --straight")
        True
    """
    what = "more stages than there are nodes" if needed is None else f"at least {needed} stages"
    return (
        f"a straight pipeline within the memory limit of {limit:.6g} bytes per worker "
        f"needs {what} (one worker each), but there are only {workers} workers; "
        + (f"give --workers {needed}, " if needed else "")
        + "raise --memory, or drop --straight"
    )


def memory_advice(limit: float, workers: int, smallest: float) -> str:
    """The message for a memory limit no plan fits, naming the smallest that does.

    Example:
        >>> memory_advice(1e9, 3, 1.5e9).endswith("fits is 1.5e+09 bytes (give --memory 1500000000 or more)")
        True
    """
    return (
        f"no plan on {workers} workers fits the memory limit of {limit:.6g} bytes per "
        f"worker; the smallest limit that fits is {smallest:.6g} bytes (give --memory "
        f"{math.ceil(smallest)} or more)"
    )
