"""The ``pipetrain`` cost model's planner: stages, replicas, schedule, micro-batches and
checkpoint mode, by the predicted step of pipetrain's own runtime.

For every micro-batch count ``N``, checkpoint mode and kind of layout (the searches of
:mod:`pipetrain.plan.candidates`), :func:`plan_pipetrain`

1. scales the profile to one micro-batch (:mod:`pipetrain.plan.microbatch_profile`);
2. finds, **exactly**, for every number of stages ``K``, the cuts and replica counts that
   minimize the slowest stage's time per step under
   :class:`~pipetrain.plan.costs_pipetrain.PipetrainCostModel`, with every worker's
   memory within the limit (:mod:`pipetrain.plan.depths`; above
   :data:`~pipetrain.plan.candidates.DEPTH_BUDGET`, only the best ``K``, by the threshold
   search of :mod:`pipetrain.plan.flat`);
3. simulates each of those plans' step under each schedule of the search that can run it
   (:mod:`pipetrain.plan.simulated_step`): fill and drain, messages, the all-reduce of
   replicated stages, the optimizer step, and the busiest link's time if longer (the
   predicted step); in the order of a lower bound of the step (each
   rank's work, one action after the other), stopping at the first bound above the best
   step found (a plan it skips cannot be faster);

and keeps the fastest simulated step (then the least memory, then ``1f1b``, ``zb-h1``,
``gpipe`` in that order, then fewer micro-batches).

What is exact and what is not: step 2 is exact for its objective (the slowest stage's
busy time per step), per candidate and depth; the choice among them is by simulation. A
plan whose slowest stage is slower than the best of its depth but whose step simulates
faster (a smaller fill and drain) is not looked for, and where several plans of a depth
share the best slowest stage the program keeps one of them. Without a memory limit,
re-materializing only adds time, so ``never`` is the only mode tried (an exact pruning:
the simulated step can only grow with the costs).

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

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.plan.candidates import (
    DEPTH_BUDGET,
    EXHAUSTIVE_PLANS,
    Search,
    most_workers,
    searches,
    step_microbatch_counts,
)
from pipetrain.plan.costs_pipetrain import FSDP_POLICIES, Candidate, PipetrainCostModel
from pipetrain.plan.effort import Effort
from pipetrain.plan.flat import (
    memory_advice,
    smallest_memory,
    straight_advice,
    straight_stages_needed,
)
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.microbatch_profile import (
    MAX_MICROBATCHES,
    microbatch_profile,
)
from pipetrain.plan.per_stage import resolve_stage_modes, stage_models
from pipetrain.plan.plan_file import Plan, PlanStage, profile_identity
from pipetrain.plan.planner_config import PlannerConfig
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch, Stages
from pipetrain.plan.simulated_step import one_stage_step, predicted_step, step_lower_bound

__all__ = ["plan_for_layout", "plan_pipetrain", "schedule_steps"]

logger = logging.getLogger(__name__)

_PREFERENCE = ("1f1b", "zb-h1", "zb-h2", "gpipe")
"""Between plans as fast and as small: the runtime's default first."""

_POLICY_ORDER = tuple(FSDP_POLICIES)

SAME_SPEED = 1e-3
"""Predicted steps within this fraction of each other count as equally fast: then the
plan needing less memory wins (a microsecond is not worth more memory)."""


def prefer(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether ``a = (step, memory)`` beats ``b``: faster by more than :data:`SAME_SPEED`,
    or as fast and smaller.

    Example:
        >>> prefer((13.000001, 35e3), (13.000004, 24e3)), prefer((12.0, 35e3), (13.0, 24e3))
        (False, True)
    """
    (step_a, memory_a), (step_b, memory_b) = a, b
    if abs(step_a - step_b) > SAME_SPEED * max(step_a, step_b):
        return step_a < step_b
    return memory_a < memory_b


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


@dataclass(frozen=True)
class _Option:
    """A plan under one schedule, not simulated yet: its lower bound and memory."""

    bound: float
    memory: float
    candidate: Candidate
    search: FlatSearch
    stages: Stages


def _option(entry: Search, stages: Stages, schedule: str, config: PlannerConfig,
            effort: Effort | None = None, built: set[tuple[Any, ...]] | None = None
            ) -> _Option | None:
    """The plan under ``schedule``; None when the schedule cannot run it or it does not
    fit the memory limit. ``effort`` is charged for building its step's schedule unless
    ``built`` holds it (the schedules are kept, :func:`step_schedule`)."""
    search, base = entry.search, entry.candidate
    workers = config.topology.num_workers
    replicas = [r for _, _, r in stages]
    loads = [search.load(a, b) for a, b, _ in stages]
    candidate = resolve_stage_modes(loads, replicas, dataclasses.replace(base, schedule=schedule),
                                    memory_limit=config.memory_limit, num_workers=workers)
    if candidate is None:
        return None
    models = stage_models(candidate, len(stages), num_workers=workers)
    if not all(model.runs(load, r) for model, load, r in zip(models, loads, replicas)):
        return None
    after, memory = sum(replicas), 0.0
    for model, load, r in zip(models, loads, replicas):
        memory = max(memory, model.stage_memory(load, replicas=r, workers_from_stage=after))
        after -= r
    if config.memory_limit is not None and memory > config.memory_limit:
        return None
    key = (schedule, candidate.num_microbatches, tuple(replicas))
    if effort is not None and (built is None or key not in built):
        effort.charge(schedule_steps(replicas, candidate.num_microbatches),
                      what=f"building the {schedule} schedule of {sum(replicas):,} workers")
        if built is not None:
            built.add(key)
    try:
        bound = step_lower_bound(loads, replicas, candidate, bandwidth=search.level.bandwidth)
    except ValueError as error:
        logger.debug("%s cannot run %s: %s", schedule, replicas, error)
        return None
    return _Option(bound, memory, candidate, search, stages)


def _simulated(option: _Option) -> _Scored:
    search = option.search
    loads = [search.load(a, b) for a, b, _ in option.stages]
    step = predicted_step(loads, [r for _, _, r in option.stages], option.candidate,
                          bandwidth=search.level.bandwidth)
    return _Scored(option.candidate, search, option.stages, step, option.memory)


def plan_pipetrain(profile: Profile, config: PlannerConfig, *,
                   exhaustive: int = EXHAUSTIVE_PLANS, depth_budget: int = DEPTH_BUDGET,
                   effort: Effort | None = None) -> Plan:
    """The plan with the fastest simulated step (see the module docstring); a search with
    at most ``exhaustive`` plans simulates them all, else the best of each depth when that
    program costs at most ``depth_budget``, else the best of any depth. ``effort`` bounds
    the work and reports progress (None: ``config.max_work``, no reports).

    Raises:
        ValueError: a topology of several levels, or no plan within the memory limit (the
            message gives the smallest limit that fits, or the workers a straight pipeline
            needs), or none that the runtime can run at the micro-batch counts tried (found
            before any search when no plan can use all the workers);
            :class:`~pipetrain.plan.effort.PlanTooLarge` past the work limit.
    """
    if config.topology.num_levels > 1:
        raise ValueError(
            f"the pipetrain cost model plans one-level topologies, and this one has "
            f"{config.topology.num_levels} levels; fix: --cost-model pipedream (PipeDream's "
            f"hierarchical planner), or plan the flat cluster (--workers "
            f"{config.topology.num_workers} --bandwidth {config.topology.levels[-1].bandwidth:g})"
        )
    effort = effort if effort is not None else Effort(limit=config.max_work)
    most = most_workers(profile, config)
    if not config.fewer_workers and config.topology.num_workers > most:
        raise ValueError(_too_many_workers(profile, config, most))
    effort.fix = (
        ("" if config.fewer_workers else "--fewer-workers (no program over exact worker "
         "counts), ") + "fewer --workers, fewer micro-batch counts to try (--microbatches "
        "with one or two values), or --cost-model pipedream"
    )
    found = searches(profile, config, effort=effort)
    options = []
    built: set[tuple[Any, ...]] = set()
    for index, entry in enumerate(found):
        candidate = entry.candidate
        effort.task = (f"search {index + 1} of {len(found)} ({candidate.num_microbatches} "
                       f"micro-batches, {'/'.join(entry.schedules)})")
        for stages in entry.plans(fewer_workers=config.fewer_workers, exhaustive=exhaustive,
                                  depth_budget=depth_budget):
            for schedule in entry.schedules:
                if (option := _option(entry, stages, schedule, config, effort,
                                      built)) is not None:
                    options.append(option)
    options.sort(key=lambda option: option.bound)
    effort.task = f"simulating up to {len(options)} plans"
    best: _Scored | None = None
    simulated = 0
    for option in options:  # in the order of their lower bounds, until none can win
        if best is not None and option.bound > best.step * (1 + SAME_SPEED):
            break
        effort.tick(f"{simulated} simulated")
        effort.charge(schedule_steps([r for _, _, r in option.stages],
                                     option.candidate.num_microbatches, built=True),
                      what=f"simulating a step on {sum(r for _, _, r in option.stages):,} workers")
        scored = _simulated(option)
        simulated += 1
        if best is None or _beats(scored, best):
            best = scored
    logger.debug("%d plans listed, %d simulated", len(options), simulated)
    if best is None:
        raise ValueError(_advice(found, config))
    return _plan(profile, best, config)


def plan_for_layout(profile: Profile, balance: Sequence[int], replicas: Sequence[int],
                    config: PlannerConfig) -> Plan:
    """The plan of a given cut of a layer sequence (``balance[j]`` layers on
    ``replicas[j]`` workers, stage by stage): its schedule, micro-batches and checkpoint
    mode chosen as :func:`plan_pipetrain` chooses them, and its predicted step.

    Example:
        >>> from pipetrain.plan.planner_config import PlannerConfig
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.topology import Topology
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0)
        ...                for k in range(4))
        >>> plan = plan_for_layout(Profile(layers=layers, batch_size=4), [3, 1], [1, 1],
        ...                        PlannerConfig(topology=Topology.flat(2, 1e9)))
        >>> plan.schedule, plan.num_microbatches, plan.time_per_step  # 2 x 4.5 on stage 0
        ('1f1b', 2, 9.0)

    Raises:
        ValueError: a graph profile, a layout that does not cover the layers or uses more
            workers than the config has, or no choice that runs it within the memory.
    """
    if not profile.is_sequence or sum(balance) != profile.num_layers \
            or len(balance) != len(replicas) or sum(replicas) > config.topology.num_workers:
        raise ValueError(
            f"balance {list(balance)} with replicas {list(replicas)} is not a layout of "
            f"this profile's {profile.num_layers} layers on {config.topology.num_workers} "
            f"workers; fix: layers per stage adding up to {profile.num_layers}, one "
            "replica count per stage (a layer sequence's profile)"
        )
    cuts = [0]
    for count in balance:
        cuts.append(cuts[-1] + count)
    stages = [(a, b, r) for a, b, r in zip(cuts, cuts[1:], replicas)]
    options = [option for entry in searches(profile, config) for schedule in entry.schedules
               if (option := _option(entry, stages, schedule, config)) is not None]
    if not options:
        raise ValueError(f"no schedule, micro-batch count and checkpoint mode runs balance "
                         f"{list(balance)} with replicas {list(replicas)} within the memory")
    best = _simulated(options[0])
    for option in options[1:]:
        scored = _simulated(option)
        if _beats(scored, best):
            best = scored
    return _plan(profile, best, config)


def schedule_steps(replicas: Sequence[int], num_microbatches: int, *,
                   built: bool = False) -> int:
    """About the steps (:mod:`pipetrain.plan.effort`) of building and validating one
    step's schedule on ``replicas`` (per stage): some per action, and some per pair of
    ranks (replica groups are checked against each other); ``built``: of simulating it
    once built (per action only).

    Example:
        >>> schedule_steps([64] * 100, 64) > schedule_steps([64] * 100, 64, built=True)
        True
    """
    ranks = sum(replicas)
    actions = 6 * len(replicas) * num_microbatches + 2 * ranks
    if built:
        return 25 * actions
    return 125 * actions + ranks * ranks // 9


def _beats(a: _Scored, b: _Scored) -> bool:
    """:func:`prefer`, then the preferred schedule, then fewer micro-batches; between
    replicated and FSDP plans as fast as each other, the replicated one (FSDP's cost
    beyond its collectives, a gather per layer and no fused weight-gradient backward, is
    not modelled: it is chosen for the memory it saves, not for a tie), and between FSDP
    policies as fast as each other, the one with fewer collectives."""
    same_speed = abs(a.step - b.step) <= SAME_SPEED * max(a.step, b.step)
    if a.candidate.data_parallel != b.candidate.data_parallel and same_speed:
        return a.candidate.data_parallel == "replicate"
    if a.candidate.fsdp_policy != b.candidate.fsdp_policy and same_speed:  # fewer collectives
        return _POLICY_ORDER.index(a.candidate.fsdp_policy) < _POLICY_ORDER.index(
            b.candidate.fsdp_policy)
    if prefer((a.step, a.memory), (b.step, b.memory)) or prefer((b.step, b.memory),
                                                                   (a.step, a.memory)):
        return prefer((a.step, a.memory), (b.step, b.memory))
    return a.key[2:] < b.key[2:]


def _too_many_workers(profile: Profile, config: PlannerConfig, most: int) -> str:
    """Why no plan uses all the workers: too few stages times micro-batches."""
    workers, nodes = config.topology.num_workers, profile.num_layers
    what = "layers" if profile.is_sequence else "nodes"
    counts = sorted(step_microbatch_counts(profile, config))
    source = ("--microbatches times the first stage's replicas" if config.num_microbatches
              else f"the divisors of the profile's batch of {profile.batch_size} samples, up "
                   f"to {MAX_MICROBATCHES}")
    needed = -(-workers // nodes)
    return (
        f"no plan on {workers} workers runs with {counts} micro-batches per step ({source}): "
        f"a stage runs on at most as many replicas as a step has micro-batches, and the "
        f"profile's {nodes} {what} make at most {nodes} stages, so a plan uses at most "
        f"{most} workers; fix: --workers {most} or fewer, --fewer-workers (leave the rest "
        f"idle), or --microbatches {needed} or more (per replica of the first stage; the "
        f"profile's batch should then have at least {needed} samples)"
    )


def _advice(found: list[Search], config: PlannerConfig) -> str:
    """Why no candidate has a plan: the smallest memory limit, the stages a straight
    pipeline needs, or micro-batches too few for the workers."""
    limit, workers = config.memory_limit, config.topology.num_workers
    counts = sorted({entry.candidate.num_microbatches for entry in found})
    if limit is None or not found:
        return (f"no plan on {workers} workers runs with {counts or 'the'} micro-batches "
                "per step (a stage cannot have more replicas than micro-batches); fix: a "
                "larger batch in the profile, more --microbatches, or --fewer-workers")
    if config.straight:  # more stages may fit where these workers cannot
        needed = [straight_stages_needed(FlatSearch(
            e.search.graph, model=e.search.model, level=e.search.level,
            num_workers=e.search.graph.num_nodes, straight=True, memory_limit=limit))
            for e in found if e.group == 1]
        fitting = [n for n in needed if n is not None]
        if fitting and min(fitting) > workers:
            return straight_advice(limit, workers, min(fitting))
    smallest = [smallest_memory(e.search, fewer_workers=config.fewer_workers) for e in found]
    values = [m for m in smallest if m is not None]
    if not values:
        return f"no plan on {workers} workers runs at all; fix: --fewer-workers"
    return memory_advice(limit, workers, min(values))


def _plan(profile: Profile, best: _Scored, config: PlannerConfig) -> Plan:
    search, candidate = best.search, best.candidate
    workers, bandwidth = config.topology.num_workers, search.level.bandwidth
    model = PipetrainCostModel(candidate, num_workers=workers)
    models = stage_models(candidate, len(best.stages), num_workers=workers)
    after = sum(r for _, _, r in best.stages)
    stages = []
    for model, (a, b, r) in zip(models, best.stages):
        load = search.load(a, b)
        stages.append(PlanStage(
            nodes=search.graph.node_ids(a, b),
            replicas=r,
            time=model.stage_time(load, replicas=r, level=search.level),
            memory_per_worker=model.stage_memory(load, replicas=r, workers_from_stage=after),
        ))
        after -= r
    replicated = None
    if candidate.data_parallel == "fsdp":  # what the same plan would need replicated
        replicated_models = stage_models(dataclasses.replace(
            candidate, data_parallel="replicate", reshard_after_forward=False,
            reduce_each_microbatch=False),
                                         len(best.stages), num_workers=workers)
        after = sum(r for _, _, r in best.stages)
        replicated = 0.0
        for copies, (a, b, r) in zip(replicated_models, best.stages):
            replicated = max(replicated, copies.stage_memory(search.load(a, b), replicas=r,
                                                             workers_from_stage=after))
            after -= r
    whole = CutGraph(profile, max_cuts=config.max_cuts)
    one = predicted_step([whole.load(0, whole.full)], [1], Candidate(), bandwidth=bandwidth)
    shares = CutGraph(microbatch_profile(profile, workers), max_cuts=config.max_cuts)
    data_parallel = one_stage_step(shares.load(0, shares.full), workers,
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
        single_worker_time=one,
        data_parallel_time=data_parallel,
        profile=profile_identity(profile),
        schedule=candidate.schedule,
        num_microbatches=candidate.num_microbatches // best.stages[0][2],
        checkpoint=(",".join(candidate.stage_checkpoints) if candidate.stage_checkpoints
                    else candidate.checkpoint),
        data_parallel=candidate.data_parallel,
        reshard_after_forward=candidate.reshard_after_forward,
        reduce_each_microbatch=candidate.reduce_each_microbatch,
        replicated_memory=replicated,
    )
