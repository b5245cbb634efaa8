"""``pipetrain train --balance auto``: profile the GPT, plan its cut, agree on it.

Rank 0 profiles every layer of the run's model on its device (the rows of one batch that
one replica of the pipeline trains, with the run's thread count), plans a straight
pipeline of the run's stages with the ``pipetrain`` cost model, which also chooses the
schedule, the micro-batches per step and the checkpoint mode among those the user did
not give (``--schedule``, ``--microbatches``, ``--checkpoint`` fix them), and writes
``profile.json`` and ``plan.json`` into the run folder. Every rank takes the cut and the
choices it found (one broadcast), so all agree whatever their timings.

With ``--replicas D`` the plan is one replica's pipeline (a ``D``-th of the batch); the
all-reduce between replicas is left out of its prediction. An interleaved schedule runs
several stages per rank, which a plan does not describe: its cut is planned with the
``pipedream`` cost model (each stage's compute), as before there was a ``pipetrain`` one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_model import RunDataset
from pipetrain.cli.train_options import stages_per_rank
from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss

__all__ = ["LOOPBACK_BANDWIDTH", "agree_on_balance", "plan_balance_for", "plan_choices",
           "planner_config"]

logger = logging.getLogger(__name__)

LOOPBACK_BANDWIDTH = 1e9
"""Bytes per second the planner assumes between the run's workers (one host)."""

_CHOICES = (("schedule", "schedule", "schedules"),
            ("microbatches", "num_microbatches", "num_microbatches"),
            ("checkpoint", "checkpoint", "checkpoints"))
"""(option, plan field, PlannerConfig field) of the choices a plan makes."""


def planner_config(args: RunConfig, stages: int) -> Any:
    """The :class:`~pipetrain.plan.PlannerConfig` of the run: a straight pipeline of
    ``stages``, with the schedule, micro-batches and checkpoint mode the user gave."""
    from pipetrain.plan import PlannerConfig, Topology

    topology = Topology.flat(stages, LOOPBACK_BANDWIDTH)
    if stages_per_rank(args) > 1:
        return PlannerConfig(topology=topology, straight=True, cost_model="pipedream")
    fixed: dict[str, Any] = {field: (getattr(args, option),) for option, _, field in _CHOICES
                             if args.given(option)}
    return PlannerConfig(topology=topology, straight=True, cost_model="pipetrain", **fixed)


def plan_balance_for(args: RunConfig, model_config: GPTConfig, dataset: RunDataset,
                     *, device: torch.device) -> tuple[list[int], Any, Any]:
    """Profile the model and plan its cut: ``(balance, plan, profile)`` (this process)."""
    from pipetrain.plan import make_plan
    from pipetrain.plan.profiler import profile_model

    rows = max(1, args.batch_size // args.replicas)
    tokens, targets = dataset.batch(0, rows)
    microbatch = max(1, rows // args.microbatches)
    profile = profile_model(gpt_layer_factories(model_config, seed=args.seed), tokens,
                            microbatch_size=microbatch, loss_fn=gpt_loss, target=targets,
                            device=device)
    stages = args.stages * stages_per_rank(args)
    plan = make_plan(profile, planner_config(args, stages))
    return [len(stage.nodes) for stage in plan.stages], plan, profile


def plan_choices(args: RunConfig, plan: Any) -> dict[str, Any]:
    """The options the plan sets: its schedule, micro-batches and checkpoint mode, where
    it chose them and the user did not give them.

    Example:
        >>> from pipetrain.plan import Plan, PlanStage
        >>> plan = Plan(stages=(PlanStage(nodes=(0,), replicas=1),), cost_model="pipetrain",
        ...             time_per_step=1.0, num_workers=1, schedule="zb-h1",
        ...             num_microbatches=4, checkpoint="never")
        >>> from pipetrain.cli.run_config import RunConfig
        >>> plan_choices(RunConfig(sources={"schedule": "command line"}), plan)
        {'microbatches': 4, 'checkpoint': 'never'}
    """
    return {option: getattr(plan, field) for option, field, _ in _CHOICES
            if getattr(plan, field) is not None and not args.given(option)}


def agree_on_balance(args: RunConfig, model_config: GPTConfig, dataset: RunDataset,
                     *, device: torch.device) -> RunConfig:
    """The run's configuration with the cut rank 0 planned (every rank calls it; rank 0
    writes the files), and the plan's schedule, micro-batches and checkpoint mode where
    the user did not give them (their source: ``planner``)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        balance, plan, profile = plan_balance_for(args, model_config, dataset, device=device)
        os.makedirs(args.folder, exist_ok=True)
        profile.save(os.path.join(args.folder, "profile.json"))
        plan.save(os.path.join(args.folder, "plan.json"))
        chosen = plan_choices(args, plan)
        logger.info("--balance auto: %s %s (predicted %.4g s per step)", balance, chosen,
                    plan.time_per_step)
        box = [(balance, chosen)]
    dist.broadcast_object_list(box, src=0)
    balance, chosen = box[0]
    return args.replace("planner", balance=",".join(map(str, balance)), **chosen)
