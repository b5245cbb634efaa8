"""Setting up one process of a :class:`~pipetrain.api.pipeline.Pipeline`: its layers, its
replica group, and the peer monitor.

Every process of the job calls these in the same order (they create process groups and
agree on names).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.api.layout import LayerSource, Layout
from pipetrain.runtime.monitor import PeerMonitor
from pipetrain.runtime.process_group import DistContext

__all__ = ["build_layers", "replica_group", "start_monitor"]


def build_layers(source: LayerSource, *, layout: Layout, local_stages: Collection[int],
                 device: torch.device) -> dict[int, nn.Module]:
    """This rank's layers by global index (factories are called only for them).

    Raises:
        TypeError: a factory returned something other than an ``nn.Module``.

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> layout = Layout.create(PipelineConfig(num_stages=2), num_layers=4)
        >>> sorted(build_layers([nn.ReLU] * 4, layout=layout, local_stages=(1,),
        ...                     device=torch.device("cpu")))
        [2, 3]
    """
    indices = [i for j in sorted(local_stages) for i in layout.layer_ranges[j]]
    layers: dict[int, nn.Module] = {}
    for i in indices:
        layer = source[i] if isinstance(source, nn.Sequential) else source[i]()
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"layer factory {i} returned {type(layer).__name__}, not an nn.Module; "
                "fix: each factory must build and return one layer"
            )
        layers[i] = layer.to(device)
    return layers


def replica_group(layout: Layout, *, pipeline_rank: int) -> Any:
    """The process group of ``pipeline_rank``'s replicas (every rank calls it: one group
    per pipeline rank is created, in order)."""
    mine: Any = None
    for p, ranks in enumerate(layout.groups):
        group = dist.new_group(list(ranks))
        if p == pipeline_rank:
            mine = group
    return mine


def start_monitor(context: DistContext | None, *, rank: int, dead_after: float,
                  exit_after: float | None = None) -> PeerMonitor | None:
    """Start the heartbeats of this rank (a collective: the ranks agree on a namespace);
    ``exit_after``: see :class:`~pipetrain.runtime.monitor.PeerMonitor`'s ``grace``."""
    if context is None:
        return None
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    monitor = PeerMonitor(
        context.store,
        rank=rank,
        world_size=dist.get_world_size(),
        namespace=str(token[0]),
        dead_after=dead_after,
        grace=exit_after,
        store_host_rank=context.store_host_rank,
    )
    monitor.start()
    return monitor
