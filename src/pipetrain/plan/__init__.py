"""Automatic partitioning: profiles of a model's layers, the planner (stage replication;
PipeDream's cost model, or pipetrain's, which simulates the step and also chooses the
schedule, micro-batches and checkpoint mode), and plan files that ``Pipeline`` and
``pipetrain train --plan`` run.

The profile format, the graph and the optimizers are pure Python (no torch); the
profiler that measures a model (``profile_model``) imports torch on first use.

Example:
    >>> from pipetrain.plan import LayerProfile, PlannerConfig, Profile, Topology, make_plan
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0)
    ...                for k in range(4))
    >>> plan = make_plan(Profile(layers=layers, batch_size=8),
    ...                  PlannerConfig(topology=Topology.flat(2, 1e9), straight=True))
    >>> [stage.nodes for stage in plan.stages], plan.schedule, plan.num_microbatches
    ([(0, 1), (2, 3)], '1f1b', 8)
    >>> plan.time_per_step  # 8 micro-batches of 0.75 s per stage, and one more to fill
    6.75
"""

from typing import Any

from pipetrain.plan.cost_models import COST_MODEL_NAMES, DEFAULT_COST_MODEL, get_cost_model
from pipetrain.plan.costs import CostModel, LevelContext, StageLoad, StageRow
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.costs_pipetrain import Candidate, PipetrainCostModel
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.pipedream_format import load_pipedream_graph, parse_pipedream_graph
from pipetrain.plan.plan_file import PLAN_FORMAT, Plan, PlanStage
from pipetrain.plan.profile import PROFILE_FORMAT, LayerProfile, Profile
from pipetrain.plan.topology import Level, Topology

__all__ = [
    "COST_MODEL_NAMES",
    "DEFAULT_COST_MODEL",
    "PLAN_FORMAT",
    "PROFILE_FORMAT",
    "Candidate",
    "CostModel",
    "LayerProfile",
    "Level",
    "LevelContext",
    "PipeDreamCostModel",
    "PipetrainCostModel",
    "Plan",
    "PlanStage",
    "PlannerConfig",
    "Profile",
    "StageLoad",
    "StageRow",
    "Topology",
    "get_cost_model",
    "load_pipedream_graph",
    "make_plan",
    "parse_pipedream_graph",
]


def __getattr__(name: str) -> Any:
    if name == "profile_model":  # imports torch: loaded on first use
        from pipetrain.plan.profiler import profile_model

        return profile_model
    raise AttributeError(f"module 'pipetrain.plan' has no attribute {name!r}")
