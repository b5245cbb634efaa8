"""Tied weights across stages, and the initial agreement of every copy of every weight.

A tie names parameters of several layers that are one weight (the input embedding and
the output head of a language model). Copies that land on the same rank become one
``nn.Parameter``; copies on different ranks get a process group (every holder, in every
replica) in which their gradients are summed, so that they stay identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.api.layout import Layout, Tie
from pipetrain.api.optimizer_step import TiedParameter

__all__ = ["broadcast_initial_weights", "tie_layers"]


def _resolve(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, attr = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr


def tie_layers(
    layers: Mapping[int, nn.Module], ties: Sequence[Tie], *, layout: Layout, pipeline_rank: int,
    replica: int | None = None,
) -> list[TiedParameter]:
    """Share tied copies within this rank; the cross-rank ties this rank takes part in.

    Every rank must call it with the same ``ties`` (it creates process groups). With
    ``replica`` (FSDP: each replica holds another shard of the weight) a tie's group is
    the holders of that replica only, one group per replica; with tensor parallelism, of
    the layout's tensor-parallel index only.

    Raises:
        ValueError: a tie names a layer the model does not have.
        TypeError: a tied name is not an ``nn.Parameter`` of its layer.

    Example (one process, both copies local)::

        tie_layers({0: emb, 5: head}, [((0, "token.weight"), (5, "proj.weight"))],
                   layout=layout, pipeline_rank=0)   # -> [] and head.proj.weight is emb's
    """
    tied: list[TiedParameter] = []
    num_layers = layout.layer_ranges[-1].stop
    for tie in ties:
        for layer, _ in tie:
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"tie {tie} names layer {layer}, but the model has layers 0..{num_layers - 1}; "
                    "fix: give (layer index, parameter name) pairs of existing layers"
                )
        holders = sorted({layout.stage_to_rank[layout.stage_of_layer(i)] for i, _ in tie})
        local = [(i, name) for i, name in tie if i in layers]
        shared: nn.Parameter | None = None
        for i, name in local:
            owner, attr = _resolve(layers[i], name)
            param = getattr(owner, attr, None)
            if not isinstance(param, nn.Parameter):
                raise TypeError(
                    f"tie {tie}: layer {i} has no parameter {name!r}; its parameters are "
                    f"{[n for n, _ in layers[i].named_parameters()]}"
                )
            if shared is None:
                shared = param
            else:
                setattr(owner, attr, shared)
        if len(holders) == 1:
            continue  # all copies on one rank: one shared parameter, reduced as usual
        group = None  # one group per tensor-parallel index (and replica), in the same order
        for t in range(layout.tensor_parallel):  # on every rank
            groups = dataclasses.replace(layout, tp_index=t).groups
            for d in (range(layout.replica_counts[holders[0]]) if replica is not None else [None]):
                ranks = sorted(g for r in holders for g in groups[r]) if d is None else sorted(
                    groups[r][d] for r in holders)
                made = dist.new_group(ranks)
                if t == layout.tp_index and d == replica:
                    group = made
        if shared is not None:
            first_stage = min(layout.stage_of_layer(i) for i, _ in local)
            tied.append(TiedParameter(shared, first_stage, group,
                                      counts_in_norm=pipeline_rank == holders[0]))
    return tied


def broadcast_initial_weights(
    model: nn.Module, ties: Sequence[TiedParameter], *, layout: Layout, pipeline_rank: int,
    dp_group: Any,
) -> None:
    """Make every replica start from replica 0's weights and every tied copy from the
    first holder's (factories already agree; this guards against ones that do not)."""
    with torch.no_grad():
        if layout.replica_counts[pipeline_rank] > 1:
            src = layout.global_rank(pipeline_rank=pipeline_rank, replica=0)
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=src, group=dp_group)
        for tie in ties:
            src = min(dist.get_process_group_ranks(tie.group))
            dist.broadcast(tie.param, src=src, group=tie.group)
