"""Running a plan: the :class:`~pipetrain.api.config.PipelineConfig` of a plan file.

A plan (``pipetrain plan --out plan.json``, :class:`pipetrain.plan.Plan`) cuts a layer
sequence into stages of consecutive layers and gives each stage its number of workers;
the pipeline it describes has one pipeline rank per stage, stage ``j`` on
``replicas[j]`` processes. The schedule, micro-batch count and checkpoint mode come from
the plan when its cost model chose them, else from the arguments (or the defaults).
"""

from __future__ import annotations

import os
from typing import Any

from pipetrain.api.config import PipelineConfig
from pipetrain.plan.plan_file import Plan

__all__ = ["config_from_plan", "plan_balance"]


def plan_balance(plan: Plan) -> list[int]:
    """The layers per stage of a plan for a layer sequence.

    Raises:
        ValueError: a stage's nodes are not consecutive layer indices in pipeline order
            (a plan for a graph model: run it through the frontend, which maps node
            names to its units).

    Example:
        >>> from pipetrain.plan import PlanStage
        >>> plan = Plan(stages=(PlanStage(nodes=(0, 1, 2), replicas=2),
        ...                     PlanStage(nodes=(3,), replicas=1)),
        ...             cost_model="pipedream", time_per_step=1.0, num_workers=3)
        >>> plan_balance(plan)
        [3, 1]
    """
    balance: list[int] = []
    expected = 0
    for j, stage in enumerate(plan.stages):
        nodes = list(stage.nodes)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in nodes):
            raise ValueError(
                f"plan stage {j} names nodes {nodes[:4]}{'...' if len(nodes) > 4 else ''}: "
                "a layer sequence's plan names layer indices; this plan is for a graph "
                "model (plan a profile of the layer sequence you train)"
            )
        if sorted(nodes) != list(range(expected, expected + len(nodes))):
            raise ValueError(
                f"plan stage {j} holds layers {sorted(nodes)}, not the consecutive layers "
                f"{expected}..{expected + len(nodes) - 1} that follow stage {j - 1}"
            )
        expected += len(nodes)
        balance.append(len(nodes))
    return balance


def config_from_plan(plan: Plan | str | os.PathLike[str], *, num_layers: int | None = None,
                     model: dict[str, Any] | None = None, **fields: Any) -> PipelineConfig:
    """The configuration that runs ``plan`` (a :class:`~pipetrain.plan.Plan` or its file).

    ``fields`` set the other :class:`PipelineConfig` fields and override the plan's
    schedule, micro-batches and checkpoint mode. With ``num_layers`` (the model's), a
    plan for another model is refused, naming both counts; with ``model`` (the model's
    identity, :func:`pipetrain.plan.profiler.identify_model`), a plan whose profile was
    taken of another model is refused, naming both models.

    Example:
        >>> from pipetrain.plan import PlanStage
        >>> plan = Plan(stages=(PlanStage(nodes=(0, 1, 2), replicas=2),
        ...                     PlanStage(nodes=(3,), replicas=1)),
        ...             cost_model="pipetrain", time_per_step=1.0, num_workers=3,
        ...             schedule="1f1b", num_microbatches=4, checkpoint="never")
        >>> config = config_from_plan(plan, num_layers=4)
        >>> config.balance, config.stage_replicas, config.world_size, config.num_microbatches
        ([3, 1], (2, 1), 3, 4)
    """
    source = os.fspath(plan) if not isinstance(plan, Plan) else "the plan"
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    balance = plan_balance(plan)
    if num_layers is not None and sum(balance) != num_layers:
        raise ValueError(
            f"{source} cuts {sum(balance)} layers (its profile: "
            f"{plan.profile.get('source') or 'unknown'}, {plan.profile.get('num_nodes', '?')} "
            f"nodes) but the model has {num_layers} layers; fix: profile this model and plan "
            "again (pipetrain plan --profile ...)"
        )
    profiled = plan.profile.get("model") or {}
    if model and profiled.get("digest") and profiled["digest"] != model.get("digest"):
        raise ValueError(
            f"{source} was made from a profile of another model: it plans "
            f"{profiled.get('summary', '?')}, but this run trains {model.get('summary', '?')}; "
            "fix: profile this model and plan again (pipetrain profile, then pipetrain plan)"
        )
    replicas = tuple(stage.replicas for stage in plan.stages)
    chosen: dict[str, Any] = {"num_stages": len(balance), "balance": balance}
    if len(set(replicas)) == 1:
        chosen["replicas"] = replicas[0]
    else:
        chosen["stage_replicas"] = replicas
    for name, value in (("schedule", plan.schedule), ("num_microbatches", plan.num_microbatches),
                        ("checkpoint", plan.checkpoint)):
        if value is not None:
            chosen[name] = value
    return PipelineConfig(**(chosen | fields))
