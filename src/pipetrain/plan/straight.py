"""A straight pipeline with free communication: the plain min-max partition.

When a search's plans are a straight pipeline (one worker per stage, as many stages as
workers) of a layer sequence, no memory limit applies, and a stage's time on one worker
is just the sum of its layers' compute (PipeDream's cost model when no activation bytes
cross any cut), the planner's problem *is* the min-max contiguous partition of the
layers' ``compute_s``, the problem torchgpipe's balancers solve. The planner then asks
the one solver of that problem, :func:`pipetrain.plan.contiguous.solve`, instead of its
threshold search, so that a straight plan and ``balance_by_time`` on the same costs cut
the model the same way. Every other case (replication, communication, memory limits,
graphs, hierarchies, the ``pipetrain`` cost model) keeps the searches of
:mod:`pipetrain.plan.flat`.

Example:
    >>> from pipetrain.plan.costs import LevelContext
    >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
    >>> from pipetrain.plan.graph import CutGraph
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.search import FlatSearch
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=c, backward_s=0.0)
    ...                for k, c in enumerate([1.0, 1.0, 8.0, 1.0, 1.0]))
    >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
    ...                level=LevelContext(bandwidth=1e9), num_workers=3, straight=True)
    >>> plain_costs(s)
    [1.0, 1.0, 8.0, 1.0, 1.0]
    >>> solve_straight(s)
    ([(0, 2, 1), (2, 3, 1), (3, 5, 1)], 8.0)
"""

from __future__ import annotations

import math

from pipetrain.plan.contiguous import solve
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.search import FlatSearch, Stages

__all__ = ["plain_costs", "solve_straight"]


def plain_costs(search: FlatSearch) -> list[float] | None:
    """Per layer, in order, the costs whose contiguous sums are exactly the search's
    stage times on one worker, when its straight problem is the plain min-max partition;
    None when it is not (see the module docstring).

    The costs are the profile's ``compute_s``, summed in the order the graph sums them,
    so the solver's sums and the cost model's stage times are the same floats.
    """
    graph = search.graph
    if not graph.is_chain or search.memory_limit is not None:
        return None
    if type(search.model) is not PipeDreamCostModel:
        return None
    # PipeDream's time on one replica: max(compute, 2 * bytes in / B, 2 * bytes out / B)
    if search.level.bandwidth != math.inf and any(graph.boundary):
        return None
    layers = graph.profile.layers
    costs = [layers[v].compute_s for v in graph.topological_order]
    if not all(math.isfinite(c) and c >= 0 for c in costs):
        return None
    return costs


def solve_straight(search: FlatSearch) -> tuple[Stages, float] | None:
    """The optimal straight plan of exactly ``num_workers`` stages by
    :func:`~pipetrain.plan.contiguous.solve`, and its time, when the search is the plain
    min-max partition (:func:`plain_costs`); None otherwise, or when there are more
    workers than layers."""
    costs = plain_costs(search) if search.straight else None
    if costs is None or not 1 <= search.num_workers <= len(costs):
        return None
    stages: Stages = []
    cut = 0  # in a chain, cut k holds the first k layers
    for count in solve(costs, search.num_workers):
        stages.append((cut, cut + count, 1))
        cut += count
    return stages, search.bottleneck(stages)
