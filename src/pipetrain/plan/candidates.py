"""The searches the ``pipetrain`` cost model's planner runs: one per micro-batch count,
checkpoint mode, and kind of layout, each with the schedules whose plans it finds.

For every micro-batch count ``N`` of a step (:func:`step_microbatch_counts`: each count
the config gives per replica of the first stage times each number of replicas that stage
may have, or :func:`~pipetrain.plan.microbatch_profile.microbatch_counts`) and checkpoint
mode (the config's; else ``never``, and all three under a memory limit):

- the schedules that run stages with different replica counts (``gpipe``, ``1f1b``:
  :data:`~pipetrain.schedule.replicated.REPLICATED_SCHEDULES`) share one search with any
  replica counts (straight if the config says so);
- the others (``zb-h1``) need the same count ``D`` on every stage: for every ``D`` that
  divides the workers, a straight search over groups of ``D`` workers
  (:class:`~pipetrain.plan.costs_pipetrain.ReplicaGroups`).

A search none of whose plans can use the workers is left out: a stage runs on at most
``N`` replicas, so ``n`` nodes take at most ``n N`` workers (and with ``fewer_workers``
a search gets no more workers than that).

Without a memory limit, a stage's time depends on the schedule only through its backward
(one pass, or the two halves of ZB-H1), so the schedules of a kind with the same backward
share a search; under one, each schedule gets its own (its memory differs).

Example:
    >>> from pipetrain.plan.planner_config import PlannerConfig
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> from pipetrain.plan.topology import Topology
    >>> one = (LayerProfile(name="0", forward_s=1.0, backward_s=2.0),)
    >>> found = searches(Profile(layers=one, batch_size=2),
    ...                  PlannerConfig(topology=Topology.flat(2, 1e9)))
    >>> [(s.candidate.num_microbatches, s.schedules, s.group) for s in found]  # not N = 1
    [(2, ('gpipe', '1f1b'), 1), (2, ('zb-h1', 'zb-h2'), 2)]
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

from pipetrain.plan.costs import CostModel, LevelContext
from pipetrain.plan.costs_pipetrain import (
    FSDP_POLICIES,
    SEARCHED_CHECKPOINTS,
    UNRUNNABLE_TIME,
    Candidate,
    PipetrainCostModel,
    ReplicaGroups,
    splits_backward,
)
from pipetrain.plan.depths import best_per_depth, depth_cost
from pipetrain.plan.effort import Effort
from pipetrain.plan.flat import solve_flat
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.microbatch_profile import microbatch_counts, microbatch_profile
from pipetrain.plan.planner_config import PLANNED_SCHEDULES, PlannerConfig
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch, Stages, replicas_per_stage
from pipetrain.schedule.async_stream import ASYNC_SCHEDULES
from pipetrain.schedule.replicated import REPLICATED_SCHEDULES

__all__ = [
    "DEPTH_BUDGET",
    "EXHAUSTIVE_PLANS",
    "Search",
    "count_plans",
    "most_workers",
    "searches",
    "step_microbatch_counts",
]

logger = logging.getLogger(__name__)

EXHAUSTIVE_PLANS = 512
"""The most plans a search lists for simulation, all of them (else the best per depth)."""
DEPTH_BUDGET = 300_000
"""The most (pairs of cuts x workers^2 x stages) for which every depth is planned."""


@dataclass(frozen=True)
class Search:
    """One search, the schedules whose plans it finds, and the replicas per searched
    worker (``group``: 1, or ``D`` for plans with ``D`` replicas on every stage).

    Example:
        >>> from pipetrain.plan.planner_config import PlannerConfig
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.topology import Topology
        >>> one = (LayerProfile(name="0", forward_s=1.0, backward_s=2.0),)
        >>> found = searches(Profile(layers=one, batch_size=2),
        ...                  PlannerConfig(topology=Topology.flat(2, 1e9)))
        >>> found[-1].plans(fewer_workers=False)  # one stage on two replicas
        [[(0, 1, 2)]]
    """

    search: FlatSearch
    schedules: tuple[str, ...]
    group: int = 1

    @property
    def candidate(self) -> Candidate:
        """The micro-batches and checkpoint mode searched (and the first schedule)."""
        model = self.search.model
        base = model.model if isinstance(model, ReplicaGroups) else model
        assert isinstance(base, PipetrainCostModel)
        return base.candidate

    def plans(self, *, fewer_workers: bool, exhaustive: int = EXHAUSTIVE_PLANS,
              depth_budget: int = DEPTH_BUDGET) -> list[Stages]:
        """The plans to simulate, replicas per worker: every plan that can run and fits
        the memory limit when there are at most ``exhaustive`` plans; else the best of
        every depth where that program is small enough (``depth_budget``); else the best
        of any depth."""
        search = self.search
        if count_plans(search, fewer_workers=fewer_workers, limit=exhaustive) <= exhaustive:
            found = [(stages, 0.0) for stages in _every_plan(search, fewer_workers)]
        elif depth_cost(search) <= depth_budget:
            found = list(best_per_depth(search, fewer_workers=fewer_workers).values())
        else:
            logger.info("%d stage evaluations to plan every depth: planning the best only",
                        depth_cost(search))
            best = solve_flat(search, fewer_workers=fewer_workers)
            found = [] if best is None else [best]
        return [[(a, b, r * self.group) for a, b, r in stages]
                for stages, time in found if time < UNRUNNABLE_TIME]


def count_plans(search: FlatSearch, *, fewer_workers: bool, limit: int) -> int:
    """How many plans (chains of cuts, replicas per stage) the search has, or ``limit + 1``
    once there are more than ``limit``.

    Example:
        >>> from pipetrain.plan.costs import LevelContext
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=1.0)
        ...                for k in range(3))
        >>> s = FlatSearch(CutGraph(Profile(layers=layers)), model=PipeDreamCostModel(),
        ...                level=LevelContext(bandwidth=1e9), num_workers=2)
        >>> count_plans(s, fewer_workers=False, limit=100)  # 1 stage x 2, or 2 stages of 1
        3
    """
    if fewer_workers and search.num_workers > _FIRST_COUNT:
        # the plans on at most a few workers are some of those on at most all of them
        ways = _ways(search, limit, workers=_FIRST_COUNT)
        if sum(ways[0]) > limit:
            return limit + 1
    ways = _ways(search, limit)
    counts = range(1, search.num_workers + 1) if fewer_workers else (search.num_workers,)
    return min(limit + 1, sum(ways[0][m] for m in counts))


_FIRST_COUNT = 64
"""With ``fewer_workers``, the plans on at most this many workers are counted first."""


def _ways(search: FlatSearch, limit: int, *, workers: int | None = None) -> list[list[int]]:
    """``ways[cut][m]``: the plans of the rest of the model from the cut on exactly ``m``
    workers (``m`` up to ``workers``, default the search's), counted up to ``limit + 1``."""
    g = search.graph
    workers = search.num_workers if workers is None else min(workers, search.num_workers)
    top = replicas_per_stage(search)
    ways = [[0] * (workers + 1) for _ in range(g.num_cuts)]
    ways[g.full][0] = 1
    # within[b][m]: plans from cut b on m - top .. m - 1 workers (what a stage starting
    # before b, on 1..top of the m workers, leaves them)
    within = [[0] * (workers + 1) for _ in range(g.num_cuts)]

    def settle(b: int) -> None:
        rest, total, sums = ways[b], 0, within[b]
        for m in range(1, workers + 1):
            total += rest[m - 1] - (rest[m - 1 - top] if m - 1 - top >= 0 else 0)
            sums[m] = total

    search.effort.charge(search.num_pairs * workers // 8, what="counting the plans")
    settle(g.full)
    cap = [limit + 1] * (workers + 1)
    for a in range(g.full - 1, -1, -1):
        search.effort.tick(f"counting the plans, cut {g.full - a} of {g.full}")
        here = ways[a]
        for b in g.supersets(a):
            here = list(map(operator.add, here, within[b]))
        here = list(map(min, here, cap))
        here[0] = 0
        ways[a] = here
        settle(a)
    return ways


def _every_plan(search: FlatSearch, fewer_workers: bool) -> list[Stages]:
    """Every plan of the search that can run (no stage at the unrunnable time) and fits
    its memory limit."""
    g, workers, model = search.graph, search.num_workers, search.model
    top = replicas_per_stage(search)
    limit = search.memory_limit
    ways = _ways(search, EXHAUSTIVE_PLANS)
    out: list[Stages] = []

    def extend(a: int, left: int, stages: Stages) -> None:
        if a == g.full:
            out.append(list(stages))
            return
        for b in g.supersets(a):
            fitting = [r for r in range(1, min(left, top) + 1) if ways[b][left - r]]
            if not fitting:
                continue
            load = search.load(a, b)
            for r in fitting:
                if model.stage_time(load, replicas=r, level=search.level) >= UNRUNNABLE_TIME:
                    continue
                if limit is not None and model.stage_memory(
                        load, replicas=r, workers_from_stage=left) > limit:
                    continue
                stages.append((a, b, r))
                extend(b, left - r, stages)
                stages.pop()

    if fewer_workers:
        for m in range(1, workers + 1):
            extend(0, m, [])
    else:
        extend(0, workers, [])
    return out


def most_workers(profile: Profile, config: PlannerConfig) -> int:
    """The most workers any plan can use: a stage runs on at most as many replicas as a
    step has micro-batches (the most of those tried), and a profile of ``n`` nodes makes at
    most ``n`` stages (one worker each when straight).

    Example:
        >>> from pipetrain.plan.planner_config import PlannerConfig
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.topology import Topology
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0)
        ...                for k in range(6))
        >>> most_workers(Profile(layers=layers, batch_size=8),
        ...              PlannerConfig(topology=Topology.flat(1024, 1e9)))  # 6 stages x 8
        48
    """
    if config.straight:
        return profile.num_layers
    return profile.num_layers * max(step_microbatch_counts(profile, config))


def step_microbatch_counts(profile: Profile, config: PlannerConfig) -> tuple[int, ...]:
    """The micro-batches per step (all replicas together) the searches try: each count
    of ``config.num_microbatches`` (per replica of the first stage) times each number of
    replicas the first stage may have (one when straight), or, without counts, those that
    split the profile's batch evenly
    (:func:`~pipetrain.plan.microbatch_profile.microbatch_counts`).

    Example:
        >>> from pipetrain.plan.planner_config import PlannerConfig
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> from pipetrain.plan.topology import Topology
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=1.0),),
        ...               batch_size=8)
        >>> step_microbatch_counts(one, PlannerConfig(topology=Topology.flat(3, 1e9),
        ...                                           num_microbatches=(2, 4)))
        (2, 4, 6, 8, 12)
        >>> step_microbatch_counts(one, PlannerConfig(topology=Topology.flat(3, 1e9)))
        (1, 2, 4, 8)
    """
    if config.num_microbatches is None:
        return microbatch_counts(profile)
    first = 1 if config.straight else config.topology.num_workers
    return tuple(sorted({m * d for m in config.num_microbatches for d in range(1, first + 1)}))


def _kinds(config: PlannerConfig,
           num_microbatches: int) -> list[tuple[int, tuple[str, ...], str, str]]:
    """``(group, schedules, data_parallel, fsdp_policy)`` per search of one (N,
    checkpoint); group 0: any replicas. Groups of more replicas than ``num_microbatches``
    cannot run, and are left out. Under a memory limit and unless straight, FSDP over
    groups of 2 or more replicas too (one ``dp`` size for every stage, and schedules that
    neither split backwards nor keep several weight versions), once per policy of
    ``config.fsdp_policies``."""
    workers = config.topology.num_workers
    schedules = config.schedules or PLANNED_SCHEDULES
    free = tuple(s for s in schedules if s in REPLICATED_SCHEDULES or config.straight)
    uniform = tuple(s for s in schedules if s not in free)
    sizes = [d for d in range(1, min(workers, num_microbatches) + 1)
             if config.fewer_workers or workers % d == 0]

    def split(names: tuple[str, ...]) -> list[tuple[str, ...]]:
        """Schedules that share a search: the same stage times (the same backward) and,
        under a memory limit, the same memory (the same schedule)."""
        if config.memory_limit is not None:
            return [(name,) for name in names]
        halves = tuple(n for n in names if splits_backward(n))
        whole = tuple(n for n in names if not splits_backward(n))
        return [group for group in (whole, halves) if group]

    kinds = [(0, group, "replicate", "gathered") for group in split(free)] + [
        (d, group, "replicate", "gathered") for group in split(uniform) for d in sizes]
    if config.memory_limit is None or config.straight:  # straight: one worker per stage
        return kinds
    sharded = tuple(s for s in schedules if not splits_backward(s) and s not in ASYNC_SCHEDULES)
    return kinds + [(d, group, "fsdp", policy) for group in split(sharded)
                    for d in sizes if d > 1 for policy in config.fsdp_policies]


def searches(profile: Profile, config: PlannerConfig, *,
             effort: Effort | None = None) -> list[Search]:
    """Every search to run (see the module docstring), sharing ``effort``; a search none
    of whose plans can use the workers (more than its micro-batches times the nodes, or
    more stages than nodes) is left out, and with ``fewer_workers`` a search is given no
    more workers than its plans can use."""
    workers = config.topology.num_workers
    level = LevelContext(bandwidth=config.topology.levels[0].bandwidth)
    modes = config.checkpoints or (("never",) if config.memory_limit is None
                                   else SEARCHED_CHECKPOINTS)
    found = []
    for n in step_microbatch_counts(profile, config):
        graph = CutGraph(microbatch_profile(profile, n), max_cuts=config.max_cuts)
        for checkpoint in modes:
            for size, schedules, data_parallel, policy in _kinds(config, n):
                reshard, each = FSDP_POLICIES[policy]
                model: CostModel = PipetrainCostModel(
                    Candidate(schedule=schedules[0], num_microbatches=n, checkpoint=checkpoint,
                              per_replica=config.num_microbatches, data_parallel=data_parallel,
                              reshard_after_forward=reshard, reduce_each_microbatch=each),
                    num_workers=workers,
                )
                units = workers
                if size:
                    model, units = ReplicaGroups(model, size), workers // size  # type: ignore[arg-type]
                straight = config.straight or size > 0
                usable = graph.num_nodes * (1 if straight else n)
                if units > usable:
                    if not config.fewer_workers:
                        continue
                    units = usable
                search = FlatSearch(graph, model=model, level=level, num_workers=units,
                                    straight=straight, memory_limit=config.memory_limit,
                                    effort=effort)
                found.append(Search(search, schedules, max(1, size)))
    return found
