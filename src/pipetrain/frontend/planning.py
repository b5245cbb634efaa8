"""The planner's cut of a captured model: how many units each stage gets.

A captured model is a sequence of units, so the profiler and PipeDream's planner of
:mod:`pipetrain.plan` take it as they take a layer sequence: each unit is timed on the
example batch (forward and backward, on a copy of it) and the planner cuts a straight
pipeline. A model on the meta device cannot run, so its units are balanced by their
parameter bytes instead. In a job, rank 0 plans and every rank takes its answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.plan.contiguous import solve

__all__ = ["LOOPBACK_BANDWIDTH", "agree", "balance_by_bytes", "balance_by_profile"]

logger = logging.getLogger(__name__)

LOOPBACK_BANDWIDTH = 1e9
"""Bytes per second the planner assumes between stages (one host)."""


def balance_by_bytes(unit_bytes: Sequence[int], num_stages: int) -> list[int]:
    """Units per stage, the largest stage's parameter bytes as small as can be.

    Example:
        >>> balance_by_bytes([8, 1, 1, 1, 1], 2)
        [1, 4]
    """
    return solve([float(b) + 1.0 for b in unit_bytes], num_stages)


def balance_by_profile(units: Sequence[nn.Module], sample: Any, num_stages: int, *,
                       device: torch.device) -> list[int]:
    """Units per stage from the planner, on the units' timings on ``sample``."""
    from pipetrain.plan import PlannerConfig, Topology, make_plan
    from pipetrain.plan.profiler import profile_model

    profile = profile_model(list(units), sample, device=device, warmup=1, repetitions=3)
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(num_stages, LOOPBACK_BANDWIDTH),
                                            straight=True))
    balance = [len(stage.nodes) for stage in plan.stages]
    logger.info("planned cut of %d units into %d stages: %s (predicted %.4g s per step)",
                len(units), num_stages, balance, plan.time_per_step)
    return balance


def agree(balance: list[int] | None) -> list[int]:
    """Rank 0's ``balance`` on every rank of the job (``balance`` as is outside one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert balance is not None
        return balance
    box: list[Any] = [balance]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])
