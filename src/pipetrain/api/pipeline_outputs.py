"""What a step returns: the model's output of an evaluation step, gathered from the last
stage's replicas, and the step's mean loss.

Each replica of the last stage holds the outputs of its own micro-batches; the first
replica gathers them and merges them in micro-batch order, so the output is the whole
batch's, as the unpipelined model gives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.api.grad_check import loss_sum
from pipetrain.api.layout import Layout
from pipetrain.microbatch import merge_batches

__all__ = ["gather_outputs", "mean_loss"]


def gather_outputs(outputs: Mapping[int, Any], *, num_microbatches: int, layout: Layout,
                   holds_last: bool, broadcast: bool) -> Any:
    """The merged output of ``num_microbatches`` micro-batches on the last stage's first
    rank (on every rank with ``broadcast``; ``None`` elsewhere). Every rank calls it when
    the last stage is replicated or ``broadcast`` is set (collectives).

    Example (one process)::

        gather_outputs({0: out0, 1: out1}, num_microbatches=2, layout=layout,
                       holds_last=True, broadcast=False)    # torch.cat([out0, out1])
    """
    last_ranks = layout.ranks_of_stage(len(layout.stage_to_rank) - 1)
    first = last_ranks[0]
    mine = dict(outputs) if holds_last else {}
    if len(last_ranks) > 1:
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == first else None
        dist.gather_object(mine, parts, dst=first)
        if parts is not None:
            mine = {i: value for part in parts if part for i, value in part.items()}
    output = None
    if dist.get_rank() == first and num_microbatches:
        output = merge_batches([mine[i] for i in range(num_microbatches)])
    if broadcast:
        box = [output]
        dist.broadcast_object_list(box, src=first)
        output = box[0]
    return output


def mean_loss(losses: Iterable[torch.Tensor], *, device: torch.device) -> float:
    """The step's mean loss: the sum of this rank's (weighted) micro-batch losses,
    all-reduced over the job (every rank calls it; ranks without losses add zero).

    Example:
        >>> mean_loss([torch.tensor(0.25), torch.tensor(0.5)], device=torch.device("cpu"))
        0.75
    """
    local = loss_sum(losses, device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    return float(local)
