"""The fast searches give the optimum of the plain program (``search.py``, ``exact_dp.py``,
``hierarchy.py``, ``replica_cache.py``), on many random small models."""

from __future__ import annotations

import math
import random

import pytest

from pipetrain.plan.bisection import minimize
from pipetrain.plan.costs import LevelContext, StageLoad, StageRow
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.flat import solve_flat
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.hierarchy import solve_hierarchy
from pipetrain.plan.replica_cache import ReplicaCache
from pipetrain.plan.topology import Topology

from .helpers import MODEL, random_profile, search


@pytest.mark.parametrize("seed", range(6))
def test_threshold_search_equals_the_plain_program(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        profile = random_profile(rng, rng.randint(1, 8), dag=rng.random() < 0.5)
        workers = rng.randint(1, 9)
        options = dict(
            bandwidth=rng.choice([1e8, 1e9, 1e10]),
            straight=rng.random() < 0.3,
            memory=rng.choice([None, None, 1e9, 3e9, 1e10]),
        )
        fewer = rng.random() < 0.3
        fast = solve_flat(search(profile, workers, **options), fewer_workers=fewer)  # type: ignore[arg-type]
        reference = search(profile, workers, **options)  # type: ignore[arg-type]
        slow = exact_dp(reference, fewer_workers=fewer)
        assert (fast is None) == (slow is None), (profile, workers, options, fewer)
        if fast is None or slow is None:
            continue
        stages, time = fast
        assert time == slow[1]
        assert reference.bottleneck(stages) == time
        used = sum(r for _, _, r in stages)
        assert used <= workers and (fewer or used == workers)
        if options["memory"] is not None:
            assert reference.peak_memory(stages) <= options["memory"]  # type: ignore[operator]
        if options["straight"]:
            assert all(r == 1 for _, _, r in stages)


@pytest.mark.parametrize("seed", range(3))
def test_one_level_hierarchy_is_the_flat_program(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(60):
        profile = random_profile(rng, rng.randint(1, 7), dag=rng.random() < 0.5)
        workers, bandwidth = rng.randint(1, 6), rng.choice([1e8, 1e9, 1e10])
        straight, fewer = rng.random() < 0.3, rng.random() < 0.5
        flat = exact_dp(search(profile, workers, bandwidth=bandwidth, straight=straight),
                        fewer_workers=fewer)
        nested = solve_hierarchy(CutGraph(profile), model=MODEL,
                                 topology=Topology.flat(workers, bandwidth),
                                 straight=straight, fewer_workers=fewer)
        assert (flat is None) == (nested is None)
        if flat is not None and nested is not None:
            assert nested.time == flat[1]


def test_two_level_plans_use_every_worker_and_partition_the_model() -> None:
    rng = random.Random(7)
    for _ in range(20):
        profile = random_profile(rng, rng.randint(4, 8), dag=rng.random() < 0.5)
        graph = CutGraph(profile)
        result = solve_hierarchy(graph, model=MODEL,
                                 topology=Topology.from_lists([2, 2], [1e10, 1e9]))
        assert result is not None
        assert sum(math.prod(s.replicas_per_level) for s in result.stages) == 4
        covered = [v for s in result.stages for v in graph.nodes_between(s.first_cut, s.last_cut)]
        assert sorted(covered) == list(range(profile.num_layers))
        assert result.stages[0].first_cut == 0 and result.stages[-1].last_cut == graph.full


def test_minimize_certifies_the_optimum_and_uses_the_bound_given() -> None:
    values = [5.0, 3.0, 2.5, 2.0]  # the plans a toy probe can return, by limit
    probed: list[float] = []

    def probe(limit: float) -> list[tuple[int, int, int]] | None:
        probed.append(limit)
        fits = [v for v in values if v <= limit]
        return [(0, 1, int(min(fits) * 10))] if fits else None

    def value(plan: list[tuple[int, int, int]]) -> float:
        return plan[0][2] / 10

    assert minimize(probe, value) == ([(0, 1, 20)], 2.0)
    assert probed[-1] == math.nextafter(2.0, 0.0)  # the certificate: nothing strictly below
    probed.clear()
    assert minimize(probe, value, below=2.0) == ([(0, 1, 20)], 2.0)
    assert probed == [2.0]


def test_replica_cache_asks_again_only_where_the_bracket_ends_differ() -> None:
    loads = [StageLoad(compute_s=c, parameter_bytes=0.0, activation_bytes=0.0, input_bytes=0.0,
                       output_bytes=0.0, is_first=True, is_last=True) for c in (1.0, 6.0)]
    cache = ReplicaCache([StageRow.of(loads)], MODEL, LevelContext(bandwidth=1e9),
                         max_replicas=8)
    assert cache.row(0, 2.0) == [1, 3]
    cache.settle(found=True)
    assert cache.row(0, 1.0) == [1, 6]
    cache.settle(found=False)
    asked = cache.fresh_entries
    assert cache.row(0, 1.5) == [1, 4]  # the first entry is 1 at both ends: not asked
    assert cache.fresh_entries == asked + 1
    assert cache.events(1.0, 2.0, budget=100) == {6.0 / 3, 6.0 / 4, 6.0 / 5}
