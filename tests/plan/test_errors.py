"""Plans that cannot exist: every message names the value and the fix."""

from __future__ import annotations

import math

import pytest

from pipetrain.plan.bisection import minimize
from pipetrain.plan.cost_models import get_cost_model
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.topology import Topology

from .helpers import chain, search


def test_more_straight_stages_than_nodes() -> None:
    config = PlannerConfig(topology=Topology.flat(5, 1e9), cost_model="pipedream", straight=True)
    with pytest.raises(ValueError) as error:
        make_plan(chain([1, 1, 1]), config)
    message = str(error.value)
    assert "5 workers needs 5 stages" in message and "profile has 3 nodes" in message
    assert "at most 3 workers" in message and "--fewer-workers" in message


def test_straight_memory_limit_needing_more_stages_than_workers() -> None:
    # each layer holds 1 GB and the stage p-th from the end holds p minibatches: within
    # 4 GB the last stage takes 4 layers, the one before 2, the one before that 1, so 7
    # layers need 3 stages
    profile = chain([1] * 7, parameters=[10**9] * 7)
    config = PlannerConfig(topology=Topology.flat(2, 1e9), cost_model="pipedream", straight=True,
                           memory_limit=4e9)
    with pytest.raises(ValueError) as error:
        make_plan(profile, config)
    message = str(error.value)
    assert "needs at least 3 stages" in message and "only 2 workers" in message
    assert "--workers 3" in message


def test_memory_limit_no_plan_fits_names_the_smallest_that_does() -> None:
    profile = chain([1, 2, 3, 4], outputs=[10**8] * 4, parameters=[10**9, 0, 10**9, 0])
    config = PlannerConfig(topology=Topology.flat(3, 1e9), cost_model="pipedream", memory_limit=1e9)
    with pytest.raises(ValueError) as error:
        make_plan(profile, config)
    message = str(error.value)
    smallest = _smallest_memory(profile, 3)
    assert f"smallest limit that fits is {smallest:.6g} bytes" in message
    assert f"--memory {math.ceil(smallest)}" in message
    # and it does fit, while one byte less does not
    make_plan(profile, PlannerConfig(topology=Topology.flat(3, 1e9), cost_model="pipedream",
                                     memory_limit=smallest))
    with pytest.raises(ValueError):
        make_plan(profile, PlannerConfig(topology=Topology.flat(3, 1e9), cost_model="pipedream",
                                         memory_limit=smallest - 1))


def _smallest_memory(profile: object, workers: int) -> float:
    """The smallest peak memory of any plan on exactly ``workers`` workers, by the plain
    program over every memory value a stage can have."""
    s = search(profile, workers)  # type: ignore[arg-type]
    values = sorted({
        s.stage_memory(a, b, r, w)
        for a in range(s.graph.full) for b in s.graph.supersets(a)
        for r in range(1, workers + 1) for w in range(r, workers + 1)
    })
    for value in values:
        s.memory_limit = value
        if exact_dp(s) is not None:
            return value
    raise AssertionError("no plan at all")


def test_unknown_cost_model() -> None:
    with pytest.raises(ValueError, match=r"unknown cost model 'fastest'; known: pipedream, "
                                         r"pipetrain \(e.g. --cost-model pipetrain\)"):
        get_cost_model("fastest")
    with pytest.raises(ValueError, match=r"unknown cost model 'fastest'"):
        make_plan(chain([1]), PlannerConfig(topology=Topology.flat(1, 1e9), cost_model="fastest"))


def test_bad_configuration_values() -> None:
    with pytest.raises(ValueError, match=r"memory_limit=-1 must be a number of bytes > 0"):
        PlannerConfig(topology=Topology.flat(1, 1e9), cost_model="pipedream", memory_limit=-1)
    with pytest.raises(ValueError, match=r"one-level topology only.*--workers 8 --bandwidth"):
        PlannerConfig(topology=Topology.from_lists([4, 2], [1e10, 1e9]), cost_model="pipedream",
                      memory_limit=1e9)


def test_minimize_reports_no_plan_at_all() -> None:
    assert minimize(lambda limit: None, lambda plan: 0.0) is None
