"""The ``pipetrain`` cost model's planner: stages, replicas, schedule, micro-batches and
checkpoint mode, by the predicted step of pipetrain's own runtime.

For every micro-batch count ``N`` and checkpoint mode (and, under a memory limit, every
schedule, whose memory differs), :func:`plan_pipetrain`

1. scales the profile to one micro-batch (:mod:`pipetrain.plan.microbatch_profile`);
2. finds, **exactly**, the cuts and replica counts that minimize the slowest stage's time
   per step under :class:`~pipetrain.plan.costs_pipetrain.PipetrainCostModel` (the same
   threshold search as PipeDream's model, :mod:`pipetrain.plan.flat`), with every
   worker's memory within the limit under that schedule;
3. simulates that plan's step under each schedule that can run it
   (:mod:`pipetrain.plan.simulated_step`): fill and drain, messages, the all-reduce of
   replicated stages, the optimizer step;

and keeps the fastest simulated step (then the least memory). Schedules that run stages
with different replica counts (``gpipe``, ``1f1b``: the runtime's
:data:`~pipetrain.schedule.replicated.REPLICATED_SCHEDULES`) get the search with
replication; the others (``zb-h1``) a straight pipeline, one worker per stage.

What is exact and what is not: step 2 is exact for its objective (the slowest stage's
busy time per step), per candidate; the choice among candidates is by simulation. A plan
whose slowest stage is slower but whose fill and drain are shorter (fewer stages) is not
looked for; where several plans share the optimal slowest stage, the search returns one
of them. Without a memory limit, re-materializing only adds time, so ``never`` is the
only mode tried (an exact pruning), and the stage times do not depend on the schedule,
so one search serves them all.

Example:
    >>> from pipetrain.plan.planner_config import PlannerConfig
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.topology import Topology
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0,
    ...                             parameter_bytes=4000) for k in range(4))
    >>> plan = plan_pipetrain(Profile(layers=layers, batch_size=4),
    ...                       PlannerConfig(topology=Topology.flat(2, 1e9), straight=True))
    >>> [s.nodes for s in plan.stages], plan.schedule, plan.num_microbatches, plan.time_per_step
    ([(0, 1), (2, 3)], 'zb-h1', 4, 6.5)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipetrain.plan.costs import LevelContext, StageLoad
from pipetrain.plan.costs_pipetrain import (
    CHECKPOINT_MODES,
    UNRUNNABLE_TIME,
    Candidate,
    PipetrainCostModel,
)
from pipetrain.plan.depths import best_per_depth, depth_cost
from pipetrain.plan.flat import (
    memory_advice,
    smallest_memory,
    solve_flat,
    straight_advice,
    straight_stages_needed,
)
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.microbatch_profile import microbatch_counts, microbatch_profile
from pipetrain.plan.plan_file import Plan, PlanStage, profile_identity
from pipetrain.plan.planner_config import PLANNED_SCHEDULES, PlannerConfig
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch, Stages
from pipetrain.plan.simulated_step import simulate_step
from pipetrain.schedule.replicated import REPLICATED_SCHEDULES

__all__ = ["DEPTH_BUDGET", "plan_pipetrain"]

logger = logging.getLogger(__name__)

DEPTH_BUDGET = 300_000
"""The most (pairs of cuts x workers^2 x stages) for which every depth is planned."""
_PREFERENCE = ("1f1b", "zb-h1", "gpipe")
"""Between plans as fast and as small: the runtime's default first."""


@dataclass(frozen=True)
class _Scored:
    candidate: Candidate
    search: FlatSearch
    stages: Stages
    step: float
    memory: float

    @property
    def key(self) -> tuple[float, float, int, int]:
        """Fastest, then least memory, then the preferred schedule, then fewer
        micro-batches."""
        c = self.candidate
        rank = _PREFERENCE.index(c.schedule) if c.schedule in _PREFERENCE else len(_PREFERENCE)
        return self.step, self.memory, rank, c.num_microbatches


def _groups(schedules: tuple[str, ...], config: PlannerConfig) -> list[tuple[bool, tuple[str, ...]]]:
    """The searches to run per (N, checkpoint): (straight, the schedules sharing it)."""
    free = tuple(s for s in schedules if s in REPLICATED_SCHEDULES or config.straight)
    uniform = tuple(s for s in schedules if s not in free)
    if config.memory_limit is None:
        return [(straight, group) for straight, group in
                ((config.straight, free), (True, uniform)) if group]
    singles: list[tuple[bool, tuple[str, ...]]] = [(config.straight, (s,)) for s in free]
    return singles + [(True, (s,)) for s in uniform]


def _searches(profile: Profile, config: PlannerConfig) -> list[tuple[FlatSearch, tuple[str, ...]]]:
    """Every search to run, with the schedules whose plans it finds."""
    workers = config.topology.num_workers
    level = LevelContext(bandwidth=config.topology.levels[0].bandwidth)
    schedules = config.schedules or PLANNED_SCHEDULES
    modes = config.checkpoints or (("never",) if config.memory_limit is None else CHECKPOINT_MODES)
    found = []
    for n in config.num_microbatches or microbatch_counts(profile):
        graph = CutGraph(microbatch_profile(profile, n), max_cuts=config.max_cuts)
        for checkpoint in modes:
            for straight, group in _groups(schedules, config):
                if straight and workers > graph.num_nodes and not config.fewer_workers:
                    continue
                model = PipetrainCostModel(
                    Candidate(schedule=group[0], num_microbatches=n, checkpoint=checkpoint),
                    num_workers=workers,
                )
                search = FlatSearch(graph, model=model, level=level, num_workers=workers,
                                    straight=straight, memory_limit=config.memory_limit)
                found.append((search, group))
    return found


def _plans(search: FlatSearch, *, fewer_workers: bool) -> list[Stages]:
    """The plans of a search to simulate: the best of every depth where that program is
    small enough, else the best of any depth."""
    if depth_cost(search) <= DEPTH_BUDGET:
        found = list(best_per_depth(search, fewer_workers=fewer_workers).values())
    else:
        logger.info("%d stage evaluations to plan every depth: planning the best depth only",
                    depth_cost(search))
        best = solve_flat(search, fewer_workers=fewer_workers)
        found = [] if best is None else [best]
    return [stages for stages, time in found if time < UNRUNNABLE_TIME]


def _loads(search: FlatSearch, stages: Stages) -> list[StageLoad]:
    return [search.load(a, b) for a, b, _ in stages]


def _score(search: FlatSearch, stages: Stages, schedule: str) -> _Scored | None:
    """The plan's simulated step under ``schedule``; None when it cannot run it."""
    assert isinstance(search.model, PipetrainCostModel)
    base = search.model.candidate
    candidate = Candidate(schedule=schedule, num_microbatches=base.num_microbatches,
                          checkpoint=base.checkpoint)
    model = PipetrainCostModel(candidate, num_workers=search.num_workers)
    replicas = [r for _, _, r in stages]
    try:
        step = simulate_step(_loads(search, stages), replicas, candidate,
                             bandwidth=search.level.bandwidth).makespan
    except ValueError as error:
        logger.debug("%s cannot run %s: %s", schedule, replicas, error)
        return None
    after, memory = sum(replicas), 0.0
    for a, b, r in stages:
        memory = max(memory, model.stage_memory(search.load(a, b), replicas=r,
                                                workers_from_stage=after))
        after -= r
    if search.memory_limit is not None and memory > search.memory_limit:
        return None
    return _Scored(candidate, search, stages, step, memory)


def plan_pipetrain(profile: Profile, config: PlannerConfig) -> Plan:
    """The plan with the fastest simulated step (see the module docstring).

    Raises:
        ValueError: a topology of several levels, or no plan within the memory limit (the
            message gives the smallest limit that fits, or the workers a straight pipeline
            needs).
    """
    if config.topology.num_levels > 1:
        raise ValueError(
            f"the pipetrain cost model plans one-level topologies, and this one has "
            f"{config.topology.num_levels} levels; fix: --cost-model pipedream (PipeDream's "
            f"hierarchical planner), or plan the flat cluster (--workers "
            f"{config.topology.num_workers} --bandwidth {config.topology.levels[-1].bandwidth:g})"
        )
    best: _Scored | None = None
    searches = _searches(profile, config)
    for search, group in searches:
        for stages in _plans(search, fewer_workers=config.fewer_workers):
            for schedule in group:
                scored = _score(search, stages, schedule)
                if scored is not None and (best is None or scored.key < best.key):
                    best = scored
    if best is None:
        raise ValueError(_advice(searches, config))
    return _plan(profile, best, config)


def _advice(searches: list[tuple[FlatSearch, tuple[str, ...]]], config: PlannerConfig) -> str:
    """Why no candidate fits the memory limit: the smallest limit, or the stages needed."""
    limit, workers = config.memory_limit, config.topology.num_workers
    if limit is None:
        return (f"no plan on {workers} workers can run any of the micro-batch counts tried "
                f"({', '.join(str(s.model.candidate.num_microbatches) for s, _ in searches[:8])}"  # type: ignore[attr-defined]
                "); fix: more micro-batches per step, or fewer workers (--fewer-workers)")
    if config.straight:
        needed = [straight_stages_needed(FlatSearch(
            s.graph, model=s.model, level=s.level, num_workers=s.graph.num_nodes,
            straight=True, memory_limit=limit)) for s, _ in searches]
        fitting = [n for n in needed if n is not None]
        if not fitting or min(fitting) > workers:
            return straight_advice(limit, workers, min(fitting) if fitting else None)
    smallest = [smallest_memory(s, fewer_workers=config.fewer_workers) for s, _ in searches]
    values = [m for m in smallest if m is not None]
    assert values, "with no memory limit some candidate has a plan"
    return memory_advice(limit, workers, min(values))


def _plan(profile: Profile, best: _Scored, config: PlannerConfig) -> Plan:
    search, candidate = best.search, best.candidate
    model = PipetrainCostModel(candidate, num_workers=search.num_workers)
    after = sum(r for _, _, r in best.stages)
    stages = []
    for a, b, r in best.stages:
        load = search.load(a, b)
        stages.append(PlanStage(
            nodes=search.graph.node_ids(a, b),
            replicas=r,
            time=model.stage_time(load, replicas=r, level=search.level),
            memory_per_worker=model.stage_memory(load, replicas=r, workers_from_stage=after),
        ))
        after -= r
    workers, bandwidth = config.topology.num_workers, search.level.bandwidth
    whole = CutGraph(profile, max_cuts=config.max_cuts)
    one = simulate_step([whole.load(0, whole.full)], [1], Candidate(), bandwidth=bandwidth)
    shares = CutGraph(microbatch_profile(profile, workers), max_cuts=config.max_cuts)
    data_parallel = simulate_step([shares.load(0, shares.full)], [workers],
                                  Candidate(num_microbatches=workers), bandwidth=bandwidth)
    return Plan(
        stages=tuple(stages),
        cost_model=model.name,
        time_per_step=best.step,
        num_workers=workers,
        topology=config.topology.to_dict(),
        straight=config.straight,
        fewer_workers=config.fewer_workers,
        memory_limit=config.memory_limit,
        single_worker_time=one.makespan,
        data_parallel_time=data_parallel.makespan,
        profile=profile_identity(profile),
        schedule=candidate.schedule,
        num_microbatches=candidate.num_microbatches // best.stages[0][2],
        checkpoint=candidate.checkpoint,
    )
