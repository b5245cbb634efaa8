"""Setting up one process of a :class:`~pipetrain.api.pipeline.Pipeline`: the job's size,
its layers, its replica group, the peer monitor and the transport.

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

from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import LayerSource, Layout
from pipetrain.runtime.distributed import DistTransport
from pipetrain.runtime.links import link_groups
from pipetrain.runtime.monitor import PeerMonitor
from pipetrain.runtime.process_group import DistContext

__all__ = ["build_layers", "build_transport", "check_world", "replica_group", "start_monitor"]


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


def check_world(config: PipelineConfig) -> None:
    """Refuse a job that is not initialized, or whose size is not the layout's.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the job has another number of processes than the layout needs.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "Pipeline needs an initialized torch.distributed job; fix: call "
            "pipetrain.init_distributed() first in every process (launch the processes "
            "with `pipetrain train` or torchrun)"
        )
    world_size = dist.get_world_size()
    if world_size != config.world_size:
        counts = config.replica_counts
        need = (f"num_stages x replicas = {config.num_stages} x {config.replicas}"
                if config.stage_replicas is None else f"sum(stage_replicas={counts})")
        raise ValueError(
            f"the job has {world_size} processes but the configuration needs "
            f"{need} = {config.world_size}; fix: launch {config.world_size} processes"
            + (f" or set num_stages={world_size // config.replicas}"
               if config.stage_replicas is None else "")
        )


def build_transport(layout: Layout, *, rank: int, device: torch.device, timeout: float,
                    monitor: PeerMonitor | None, own_group: bool) -> DistTransport:
    """This rank's point-to-point transport (every rank calls it: it creates groups).

    Tensors travel on the job's backend from device to device, headers on gloo: the job's
    group, or (NCCL, or ``own_group``) a gloo group of their own, and on GPUs one NCCL
    group per direction of each link (see :mod:`pipetrain.runtime.distributed`). An
    asynchronous pipeline asks for ``own_group``: its receives stay posted between steps,
    and another pipeline's messages on the same group would land in them.
    """
    placement = layout.placement()
    on_gloo = dist.get_backend() == "gloo"
    header_group = dist.new_group(backend="gloo") if own_group or not on_gloo else None
    on_device = not on_gloo and device.type != "cpu"  # else all of it on gloo
    inbound, outbound = layout.channels(layout.position(rank)[0])
    return DistTransport(
        placement=placement,
        inbound=inbound,
        outbound=outbound,
        timeout=timeout,
        group=header_group,
        data_groups=link_groups(placement, rank=rank) if on_device else {},
        device=device,
        check=monitor.check if monitor is not None else None,
        explain=monitor.explain if monitor is not None else None,
    )
