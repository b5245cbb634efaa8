"""Tests for pipetrain.plan.straight: the planner's straight, communication-free case is the
min-max partition, solved by the one solver (pipetrain.plan.contiguous.solve)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

import pipetrain
import pipetrain.plan.straight
from pipetrain.partition import solve as partition_solve
from pipetrain.plan import LayerProfile, PlannerConfig, Profile, Topology, make_plan
from pipetrain.plan.contiguous import solve
from pipetrain.plan.costs import LevelContext
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.search import FlatSearch
from pipetrain.plan.straight import plain_costs

SOURCE = Path(pipetrain.__file__).resolve().parent


def profile_of(costs: list[float], *, output_bytes: int = 0) -> Profile:
    return Profile(layers=tuple(
        LayerProfile(name=str(k), forward_s=c, backward_s=0.0, output_bytes=output_bytes)
        for k, c in enumerate(costs)))


def straight_plan(costs: list[float], num_stages: int, **config: object) -> list[int]:
    plan = make_plan(profile_of(costs), PlannerConfig(
        topology=Topology.flat(num_stages, 1e9), cost_model="pipedream", straight=True,
        **config))  # type: ignore[arg-type]
    assert all(stage.replicas == 1 for stage in plan.stages)
    return [len(stage.nodes) for stage in plan.stages]


def random_costs(rng: random.Random) -> list[float]:
    n = rng.randint(1, 12)
    kind = rng.choice(["ties", "floats", "zeros"])
    if kind == "ties":  # whole numbers: many optimal cuts, so the tie-breaking shows
        return [float(rng.randint(1, 3)) for _ in range(n)]
    if kind == "zeros":
        return [rng.choice([0.0, 1.0]) for _ in range(n)]
    return [rng.random() for _ in range(n)]


def test_the_straight_plan_is_solve_on_the_same_costs():
    rng = random.Random(0)
    for _ in range(60):
        costs = random_costs(rng)
        for k in range(1, len(costs) + 1):
            assert straight_plan(costs, k) == solve(costs, k), (costs, k)


def test_the_straight_plan_is_optimal_under_the_planners_own_program():
    # solve's plan reaches the optimum of the planner's plain program over (cut, workers)
    rng = random.Random(1)
    for _ in range(30):
        costs = random_costs(rng)
        k = rng.randint(1, len(costs))
        plan = make_plan(profile_of(costs), PlannerConfig(
            topology=Topology.flat(k, 1e9), cost_model="pipedream", straight=True))
        search = FlatSearch(CutGraph(profile_of(costs)), model=PipeDreamCostModel(),
                            level=LevelContext(bandwidth=1e9), num_workers=k, straight=True)
        reference = exact_dp(search)
        assert reference is not None
        assert plan.time_per_step == reference[1]


def test_the_planner_asks_the_one_solver(monkeypatch):
    calls = []

    def spy(costs, num_partitions):
        calls.append((list(costs), num_partitions))
        return solve(costs, num_partitions)

    monkeypatch.setattr(pipetrain.plan.straight, "solve", spy)
    assert straight_plan([3.0, 1.0, 1.0, 2.0], 2) == [2, 2]
    assert calls == [([3.0, 1.0, 1.0, 2.0], 2)]


def test_partition_solve_is_the_planners_solver():
    assert partition_solve is solve


@pytest.mark.parametrize("case", ["communication", "memory", "replication"])
def test_other_cases_keep_the_planners_search(case):
    costs = [1.0, 2.0, 3.0, 4.0]
    profile = profile_of(costs, output_bytes=8 if case == "communication" else 0)
    search = FlatSearch(CutGraph(profile), model=PipeDreamCostModel(),
                        level=LevelContext(bandwidth=1e9), num_workers=2,
                        straight=case != "replication",
                        memory_limit=1e12 if case == "memory" else None)
    assert plain_costs(search) == (None if case != "replication" else costs)
    assert pipetrain.plan.straight.solve_straight(search) is None


def test_the_min_max_program_is_written_once():
    # the solver's dynamic program (its min-max over prefix sums) lives in one module
    program = re.compile(r"^def (solve|_min_max)\(", re.MULTILINE)
    homes = sorted(path.relative_to(SOURCE).as_posix() for path in SOURCE.rglob("*.py")
                   if program.search(path.read_text()))
    assert homes == ["plan/contiguous.py"]
