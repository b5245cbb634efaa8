"""Placing a rank's layers on the job's mesh: tied copies, first weights, tensor parallel, FSDP.

Every rank calls :func:`place_layers` once, after building its layers (it creates process
groups): the job's ``DeviceMesh`` (the user's, checked, or one built), tied copies shared
within the rank and grouped across ranks, every replica and tied copy starting from the
same weights, the tensor-parallel plan applied over ``tp`` and the layers ``fully_shard``-ed
over ``dp`` with ``data_parallel="fsdp"`` (see :mod:`.mesh`, :mod:`.ties`,
:mod:`.tensor_parallel`, :mod:`.fsdp`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.api.config import PipelineConfig
from pipetrain.api.fsdp import ShardedStages, shard_stages
from pipetrain.api.layout import Layout, Tie
from pipetrain.api.optimizer_step import TiedParameter
from pipetrain.api.pipeline_setup import job_mesh
from pipetrain.api.tensor_parallel import TensorParallelPlan, parallelize_stages
from pipetrain.api.ties import broadcast_initial_weights, tie_layers

__all__ = ["Placement", "place_layers"]


@dataclass
class Placement:
    """Where a rank's layers ended up on the job's mesh."""

    mesh: DeviceMesh | None
    """The job's mesh (``None`` when the stages have different replica counts)."""
    replica_group: Any
    """This rank's replica group (the mesh's ``dp`` group)."""
    tied: list[TiedParameter]
    """The cross-rank tied copies this rank takes part in."""
    sharded: ShardedStages | None
    """This rank's FSDP2 units (``data_parallel="fsdp"``), else ``None``."""


def place_layers(model: nn.Module, layers: Mapping[int, nn.Module], ties: Sequence[Tie], *,
                 config: PipelineConfig, layout: Layout, pipeline_rank: int, replica: int,
                 device: torch.device, mesh: DeviceMesh | None,
                 plan: TensorParallelPlan | None, captured: bool) -> Placement:
    """Place this rank's ``layers`` (held by ``model``) on the job's mesh (see the module).

    Example (in each process of a job)::

        placed = place_layers(model, layers, ties, config=config, layout=layout,
                              pipeline_rank=0, replica=0, device=torch.device("cpu"),
                              mesh=None, plan=None, captured=False)
    """
    mesh, replica_group = job_mesh(config, layout, pipeline_rank=pipeline_rank, device=device,
                                   mesh=mesh)
    fsdp = config.data_parallel == "fsdp"
    tied = tie_layers(layers, list(ties), layout=layout, pipeline_rank=pipeline_rank,
                      replica=replica if fsdp else None)
    broadcast_initial_weights(model, tied, layout=layout, pipeline_rank=pipeline_rank,
                              dp_group=replica_group)
    parallelize_stages(layers, plan, mesh=mesh, ties=ties, tensor_parallel=config.tensor_parallel,
                       captured=captured)
    sharded = None
    if fsdp:
        sharded, tied = shard_stages(layers, tied, ties=ties, mesh=mesh, config=config, layout=layout)
    return Placement(mesh=mesh, replica_group=replica_group, tied=tied, sharded=sharded)
