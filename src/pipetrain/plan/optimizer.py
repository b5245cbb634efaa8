"""The planner: a profile and a cluster in, the fastest plan under a cost model out.

:func:`make_plan` cuts the model into stages, gives each stage its number of replicas
(data-parallel workers) and checks memory, exactly optimizing the cost model's predicted
time per step (the slowest stage), then writes the result as a :class:`Plan`:

- one topology level: the threshold search of :mod:`pipetrain.plan.search` (fast for
  thousands of workers), with a memory limit, ``straight`` (one worker per stage,
  exactly as many stages as workers) and ``fewer_workers`` (leave workers idle when that
  is faster; otherwise every worker is used, as PipeDream does);
- several levels (GPUs in servers, servers in a cluster): PipeDream's hierarchical
  program, :mod:`pipetrain.plan.hierarchy`.

Example:
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.topology import Topology
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=0.1, backward_s=0.2,
    ...                             output_bytes=10**6, parameter_bytes=10**8)
    ...                for k in range(6))
    >>> plan = make_plan(Profile(layers=layers),
    ...                  PlannerConfig(topology=Topology.flat(3, 1e10)))
    >>> [(s.nodes, s.replicas) for s in plan.stages], round(plan.time_per_step, 4)
    ([((0, 1), 1), ((2, 3), 1), ((4, 5), 1)], 0.6)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import partial

from pipetrain.plan.bisection import minimize
from pipetrain.plan.cost_models import DEFAULT_COST_MODEL, get_cost_model
from pipetrain.plan.costs import CostModel, LevelContext
from pipetrain.plan.exact_count import (
    events_exact,
    events_straight,
    probe_exact,
    probe_straight_exact,
)
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.graph import DEFAULT_MAX_CUTS, CutGraph
from pipetrain.plan.hierarchy import solve_hierarchy
from pipetrain.plan.plan_file import Plan, PlanStage, profile_identity
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch, Stages
from pipetrain.plan.topology import Topology

__all__ = ["PlannerConfig", "make_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What to plan for.

    Example:
        >>> from pipetrain.plan.topology import Topology
        >>> PlannerConfig(topology=Topology.flat(8, 1e9), straight=True).cost_model
        'pipedream'
    """

    topology: Topology
    cost_model: str = DEFAULT_COST_MODEL
    memory_limit: float | None = None
    """Bytes per worker (None: no limit); one-level topologies only for now."""
    straight: bool = False
    """No replication: one worker per stage, as many stages as workers."""
    fewer_workers: bool = False
    """Leave workers idle when that is faster (PipeDream's ``--use_fewer_machines``)."""
    max_cuts: int = DEFAULT_MAX_CUTS

    def __post_init__(self) -> None:
        if self.memory_limit is not None and not (
            isinstance(self.memory_limit, (int, float)) and self.memory_limit > 0
        ):
            raise ValueError(
                f"memory_limit={self.memory_limit!r} must be a number of bytes > 0 "
                f"(e.g. 16e9), or None for no limit"
            )
        if self.memory_limit is not None and self.topology.num_levels > 1:
            raise ValueError(
                f"a memory limit works with a one-level topology only for now, and the "
                f"topology has {self.topology.num_levels} levels; plan for the flat cluster "
                f"(--workers {self.topology.num_workers} --bandwidth "
                f"{self.topology.levels[-1].bandwidth:g}) or drop --memory"
            )


def make_plan(profile: Profile, config: PlannerConfig, *, model: CostModel | None = None) -> Plan:
    """The plan with the smallest predicted time per step (see the module docstring).

    ``model`` overrides ``config.cost_model`` (for a model that is not registered).
    Raises ValueError for plans that cannot exist, naming the fix (the smallest memory
    limit that fits, the most workers a straight pipeline can take).

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=0.0),))
        >>> make_plan(one, PlannerConfig(topology=Topology.flat(4, 1e9))).time_per_step
        0.25
    """
    model = model if model is not None else get_cost_model(config.cost_model)
    graph = CutGraph(profile, max_cuts=config.max_cuts)
    workers = config.topology.num_workers
    if config.straight and not config.fewer_workers and workers > graph.num_nodes:
        raise ValueError(
            f"a straight pipeline on {workers} workers needs {workers} stages of at least "
            f"one node each, but the profile has {graph.num_nodes} nodes; use at most "
            f"{graph.num_nodes} workers, drop --straight, or add --fewer-workers"
        )
    if config.topology.num_levels > 1:
        return _hierarchical(profile, graph, model, config)
    level = config.topology.levels[0]
    context = LevelContext(bandwidth=level.bandwidth)
    search = FlatSearch(
        graph,
        model=model,
        level=context,
        num_workers=workers,
        straight=config.straight,
        memory_limit=config.memory_limit,
    )
    result = _solve_flat(search, fewer_workers=config.fewer_workers)
    if result is None:
        raise ValueError(_memory_advice(graph, model, context, config))
    stages, time = result
    return _flat_plan(profile, search, stages, time, config, model)


def _solve_flat(search: FlatSearch, *, fewer_workers: bool) -> tuple[Stages, float] | None:
    """The optimum on one level; the fewest-workers optimum first, a lower bound of the
    optimum on exactly ``num_workers`` workers and most often equal to it."""
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


def _memory_advice(
    graph: CutGraph, model: CostModel, context: LevelContext, config: PlannerConfig
) -> str:
    """Why no plan fits the memory limit, and the smallest limit (or workers) that would."""
    limit, workers = config.memory_limit, config.topology.num_workers
    assert limit is not None, "without a memory limit some plan always exists"
    if config.straight:
        stages_needed = FlatSearch(
            graph,
            model=model,
            level=context,
            num_workers=graph.num_nodes,
            straight=True,
            memory_limit=limit,
        ).probe_fewest(math.inf)
        if stages_needed is None or len(stages_needed) > workers:
            needed = "more stages than there are nodes" if stages_needed is None else (
                f"at least {len(stages_needed)} stages"
            )
            return (
                f"a straight pipeline within the memory limit of {limit:.6g} bytes per worker "
                f"needs {needed} (one worker each), but there are only {workers} workers; "
                + (f"give --workers {len(stages_needed)}, " if stages_needed else "")
                + "raise --memory, or drop --straight"
            )
    unlimited = FlatSearch(
        graph, model=model, level=context, num_workers=workers, straight=config.straight
    )

    def probe(memory: float) -> Stages | None:
        unlimited.memory_limit = None if memory == math.inf else memory
        return _feasible_plan(unlimited, config.fewer_workers)

    smallest = minimize(probe, unlimited.peak_memory)
    assert smallest is not None, "with no memory limit a plan exists"
    return (
        f"no plan on {workers} workers fits the memory limit of {limit:.6g} bytes per "
        f"worker; the smallest limit that fits is {smallest[1]:.6g} bytes (give --memory "
        f"{math.ceil(smallest[1])} or more)"
    )


def _feasible_plan(search: FlatSearch, fewer_workers: bool) -> Stages | None:
    """Any plan within the memory limit (time ignored), in the configured mode."""
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


def _node_ids(profile: Profile, nodes: list[int]) -> tuple[str | int, ...]:
    if profile.is_sequence:
        return tuple(nodes)
    return tuple(profile.layers[v].name for v in nodes)


def _flat_plan(
    profile: Profile,
    search: FlatSearch,
    stages: Stages,
    time: float,
    config: PlannerConfig,
    model: CostModel,
) -> Plan:
    after = sum(r for _, _, r in stages)
    plan_stages = []
    for a, b, r in stages:
        plan_stages.append(
            PlanStage(
                nodes=_node_ids(profile, search.graph.nodes_between(a, b)),
                replicas=r,
                time=search.stage_time(a, b, r),
                memory_per_worker=search.stage_memory(a, b, r, after),
            )
        )
        after -= r
    full, workers = search.graph.full, config.topology.num_workers
    return Plan(
        stages=tuple(plan_stages),
        cost_model=model.name,
        time_per_step=time,
        num_workers=workers,
        topology=config.topology.to_dict(),
        straight=config.straight,
        fewer_workers=config.fewer_workers,
        memory_limit=config.memory_limit,
        single_worker_time=search.stage_time(0, full, 1),
        data_parallel_time=search.stage_time(0, full, workers),
        profile=profile_identity(profile),
    )


def _hierarchical(
    profile: Profile, graph: CutGraph, model: CostModel, config: PlannerConfig
) -> Plan:
    topology = config.topology
    result = solve_hierarchy(
        graph,
        model=model,
        topology=topology,
        straight=config.straight,
        fewer_workers=config.fewer_workers,
    )
    if result is None:
        raise ValueError(
            f"no straight plan fits {topology.describe()}: each level needs as many "
            f"stages as it has units; add --fewer-workers or drop --straight"
        )
    replicas = [math.prod(s.replicas_per_level) for s in result.stages]
    after = sum(replicas)
    plan_stages = []
    for stage, r in zip(result.stages, replicas):
        a, b = stage.first_cut, stage.last_cut
        plan_stages.append(
            PlanStage(
                nodes=_node_ids(profile, graph.nodes_between(a, b)),
                replicas=r,
                time=None,
                memory_per_worker=model.stage_memory(
                    graph.load(a, b), replicas=r, workers_from_stage=after
                ),
                replicas_per_level=stage.replicas_per_level,
                outer_stage=stage.outer_stage,
            )
        )
        after -= r
    whole = graph.load(0, graph.full)
    single = model.stage_time(whole, replicas=1, level=LevelContext(
        bandwidth=topology.levels[0].bandwidth))
    data_parallel = whole.compute_s
    for k, lv in enumerate(topology.levels):
        context = LevelContext(
            bandwidth=lv.bandwidth,
            workers_per_unit=1 if k == 0 else topology.levels[k - 1].num_workers,
            level_index=k,
        )
        load = dataclasses.replace(whole, compute_s=data_parallel)
        data_parallel = model.stage_time(load, replicas=lv.num_workers, level=context)
    return Plan(
        stages=tuple(plan_stages),
        cost_model=model.name,
        time_per_step=result.time,
        num_workers=topology.num_workers,
        topology=topology.to_dict(),
        straight=config.straight,
        fewer_workers=config.fewer_workers,
        single_worker_time=single,
        data_parallel_time=data_parallel,
        profile=profile_identity(profile),
    )

