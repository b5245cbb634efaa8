"""The examples in the planner modules' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

# the planner's own modules (plan/profiler.py, which measures models with torch, is not one)
MODULES = [
    "pipetrain.plan",
    "pipetrain.plan.bisection",
    "pipetrain.plan.contiguous",
    "pipetrain.plan.cost_models",
    "pipetrain.plan.costs",
    "pipetrain.plan.costs_pipedream",
    "pipetrain.plan.costs_pipetrain",
    "pipetrain.plan.held_weights",
    "pipetrain.plan.depths",
    "pipetrain.plan.exact_count",
    "pipetrain.plan.exact_dp",
    "pipetrain.plan.flat",
    "pipetrain.plan.graph",
    "pipetrain.plan.hierarchy",
    "pipetrain.plan.microbatch_profile",
    "pipetrain.plan.optimizer",
    "pipetrain.plan.pipedream_format",
    "pipetrain.plan.plan_file",
    "pipetrain.plan.planner_config",
    "pipetrain.plan.profile",
    "pipetrain.plan.replica_cache",
    "pipetrain.plan.schedule_choice",
    "pipetrain.plan.search",
    "pipetrain.plan.simulated_step",
    "pipetrain.plan.straight",
    "pipetrain.plan.table",
    "pipetrain.plan.topology",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no examples"
