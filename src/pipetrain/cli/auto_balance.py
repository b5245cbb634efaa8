"""``pipetrain train --balance auto``: profile the GPT, plan its cut, agree on it.

Rank 0 profiles every layer of the run's model on its device (one batch of the run's
data, at the run's micro-batch size, with the run's thread count), plans a straight
pipeline of the run's stages with the planner's default cost model, and writes
``profile.json`` and ``plan.json`` into the run folder; every rank takes the cut it
found (one broadcast), so all agree on it whatever their timings.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.cli.train_options import stages_per_rank
from pipetrain.data import TextDataset
from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss

__all__ = ["LOOPBACK_BANDWIDTH", "agree_on_balance", "plan_balance_for"]

logger = logging.getLogger(__name__)

LOOPBACK_BANDWIDTH = 1e9
"""Bytes per second the planner assumes between the run's workers (one host)."""


def plan_balance_for(args: argparse.Namespace, model_config: GPTConfig, dataset: TextDataset,
                     *, device: torch.device) -> tuple[list[int], Any, Any]:
    """Profile the model and plan its cut: ``(balance, plan, profile)`` (this process)."""
    from pipetrain.plan import DEFAULT_COST_MODEL, PlannerConfig, Topology, make_plan
    from pipetrain.plan.profiler import profile_model

    tokens, targets = dataset.batch(0, args.batch_size)
    microbatch = max(1, args.batch_size // (args.microbatches * args.replicas))
    profile = profile_model(gpt_layer_factories(model_config, seed=args.seed), tokens,
                            microbatch_size=microbatch, loss_fn=gpt_loss, target=targets,
                            device=device)
    stages = args.stages * stages_per_rank(args)
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(stages, LOOPBACK_BANDWIDTH),
                                            straight=True, cost_model=DEFAULT_COST_MODEL))
    return [len(stage.nodes) for stage in plan.stages], plan, profile


def agree_on_balance(args: argparse.Namespace, model_config: GPTConfig, dataset: TextDataset,
                     *, device: torch.device) -> list[int]:
    """The cut rank 0 planned (every rank calls it; rank 0 writes the files)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        balance, plan, profile = plan_balance_for(args, model_config, dataset, device=device)
        os.makedirs(args.out, exist_ok=True)
        profile.save(os.path.join(args.out, "profile.json"))
        plan.save(os.path.join(args.out, "plan.json"))
        logger.info("--balance auto: %s (predicted %.4g s per step)", balance, plan.time_per_step)
        box = [balance]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])
