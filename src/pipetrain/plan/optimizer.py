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
    ...                  PlannerConfig(topology=Topology.flat(3, 1e10), cost_model="pipedream"))
    >>> [(s.nodes, s.replicas) for s in plan.stages], round(plan.time_per_step, 4)
    ([((0, 1), 1), ((2, 3), 1), ((4, 5), 1)], 0.6)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pipetrain.plan.cost_models import get_cost_model
from pipetrain.plan.costs import CostModel, LevelContext
from pipetrain.plan.effort import Effort
from pipetrain.plan.flat import (
    memory_advice,
    smallest_memory,
    solve_flat,
    straight_advice,
    straight_stages_needed,
)
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.hierarchy import solve_hierarchy
from pipetrain.plan.plan_file import Plan, PlanStage, profile_identity
from pipetrain.plan.planner_config import PlannerConfig
from pipetrain.plan.profile import Profile
from pipetrain.plan.schedule_choice import plan_pipetrain
from pipetrain.plan.search import FlatSearch, Stages

__all__ = ["PlannerConfig", "make_plan"]


def make_plan(
    profile: Profile,
    config: PlannerConfig,
    *,
    model: CostModel | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The plan with the smallest predicted time per step (see the module docstring).

    With the ``pipetrain`` cost model (the default) the plan also names the schedule,
    micro-batches and checkpoint mode, and its time per step is the simulated step
    (:mod:`pipetrain.plan.schedule_choice`). ``model`` overrides ``config.cost_model``
    (for a model that is not registered): the plan minimizes its slowest stage. Raises
    ValueError for plans that cannot exist, naming the fix (the smallest memory limit
    that fits, the most workers a straight pipeline can take), and
    :class:`~pipetrain.plan.effort.PlanTooLarge` (a ValueError) when the search would
    take more than ``config.max_work`` steps, naming the fix. ``progress`` gets a line
    every few seconds while the search runs (``pipetrain plan`` writes them to stderr).

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.topology import Topology
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=0.0),))
        >>> make_plan(one, PlannerConfig(topology=Topology.flat(4, 1e9),
        ...                              cost_model="pipedream")).time_per_step
        0.25
    """
    workers = config.topology.num_workers
    if config.straight and not config.fewer_workers and workers > profile.num_layers:
        raise ValueError(
            f"a straight pipeline on {workers} workers needs {workers} stages of at least "
            f"one node each, but the profile has {profile.num_layers} nodes; use at most "
            f"{profile.num_layers} workers, drop --straight, or add --fewer-workers"
        )
    effort = Effort(limit=config.max_work, report=progress)
    if model is None and config.cost_model == "pipetrain":
        return plan_pipetrain(profile, config, effort=effort)
    model = model if model is not None else get_cost_model(config.cost_model)
    graph = CutGraph(profile, max_cuts=config.max_cuts)
    if config.topology.num_levels > 1:
        effort.fix = (
            "fewer workers per level (--workers), a flat topology (one --workers and "
            "--bandwidth value: its planner's cost grows far slower), or a profile with "
            "fewer layers"
        )
        return _hierarchical(profile, graph, model, config, effort)
    effort.fix = "fewer --workers, --fewer-workers, or a profile with fewer layers"
    level = config.topology.levels[0]
    context = LevelContext(bandwidth=level.bandwidth)
    search = FlatSearch(
        graph,
        model=model,
        level=context,
        num_workers=workers,
        straight=config.straight,
        memory_limit=config.memory_limit,
        effort=effort,
    )
    result = solve_flat(search, fewer_workers=config.fewer_workers)
    if result is None:
        raise ValueError(_memory_advice(graph, model, context, config))
    stages, time = result
    return _flat_plan(profile, search, stages, time, config, model)


def _memory_advice(
    graph: CutGraph, model: CostModel, context: LevelContext, config: PlannerConfig
) -> str:
    """Why no plan fits the memory limit, and the smallest limit (or workers) that would."""
    limit, workers = config.memory_limit, config.topology.num_workers
    assert limit is not None, "without a memory limit some plan always exists"
    if config.straight:
        needed = straight_stages_needed(FlatSearch(
            graph, model=model, level=context, num_workers=graph.num_nodes, straight=True,
            memory_limit=limit,
        ))
        if needed is None or needed > workers:
            return straight_advice(limit, workers, needed)
    smallest = smallest_memory(
        FlatSearch(graph, model=model, level=context, num_workers=workers,
                   straight=config.straight),
        fewer_workers=config.fewer_workers,
    )
    assert smallest is not None, "with no memory limit a plan exists"
    return memory_advice(limit, workers, smallest)


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
                nodes=search.graph.node_ids(a, b),
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
    profile: Profile, graph: CutGraph, model: CostModel, config: PlannerConfig, effort: Effort
) -> Plan:
    topology = config.topology
    result = solve_hierarchy(
        graph,
        model=model,
        topology=topology,
        straight=config.straight,
        fewer_workers=config.fewer_workers,
        effort=effort,
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
                nodes=graph.node_ids(a, b),
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

