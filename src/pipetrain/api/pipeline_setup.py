"""Setting up one process of a :class:`~pipetrain.api.pipeline.Pipeline`: what its ranks
must agree on, the job's size, its layers, its replica group, the peer monitor and the
transport.

Every process of the job calls these in the same order (they create process groups and
agree on names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Collection, Sequence
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.api.agreement import refuse_disagreement
from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import LayerSource, Layout, Tie
from pipetrain.api.mesh import build_mesh, check_mesh
from pipetrain.microbatch import batch_size
from pipetrain.runtime.distributed import DistTransport
from pipetrain.runtime.links import link_groups
from pipetrain.runtime.monitor import PeerMonitor
from pipetrain.runtime.process_group import DistContext

__all__ = [
    "MAY_DIFFER",
    "SETUP_FIX",
    "batch_values",
    "build_layers",
    "build_transport",
    "check_world",
    "job_mesh",
    "layout_link_groups",
    "model_tensors",
    "refuse_batch_disagreement",
    "refuse_setup_disagreement",
    "replica_group",
    "setup_values",
    "start_monitor",
]

MAY_DIFFER = ("timeout", "heartbeat_timeout", "exit_when_stuck")
"""The :class:`PipelineConfig` fields that may differ between ranks: how long this
process waits before it gives up on a peer (a host's own choice). Every other field
must be the same on every rank."""

SETUP_FIX = ("build the Pipeline from the same PipelineConfig, model and arguments on every "
             f"rank (only {', '.join(MAY_DIFFER)} may differ)")
"""The fix a disagreement of the set-up shows."""


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name (the ranks compare their shapes
    and dtypes; a model on the meta device has them too).

    Example:
        >>> from pipetrain.api.agreement import shown
        >>> shown(model_tensors(nn.Linear(4, 8)))
        {'weight': '(8, 4) float32', 'bias': '(8,) float32'}
    """
    return dict([*module.named_parameters(remove_duplicate=False),
                 *module.named_buffers(remove_duplicate=False)])


def _schedule_value(config: PipelineConfig) -> str:
    user = config.user_schedule
    if user is None:
        return config.schedule_name
    fingerprint = hashlib.sha256(repr(user).encode()).hexdigest()[:12]
    return f"{user.name} (a user schedule, fingerprint {fingerprint})"


def setup_values(config: PipelineConfig, layers: Any, *, capturing: bool,
                 split_points: Sequence[str] | None, ties: Sequence[Tie]) -> dict[str, Any]:
    """What every rank of a :class:`~pipetrain.api.pipeline.Pipeline` must give alike,
    keyed as the user writes it: every :class:`PipelineConfig` field but
    :data:`MAY_DIFFER` (the schedule by its canonical name), the number of layers (a layer
    sequence), the parameter and buffer shapes of an ``nn.Sequential`` or of a model to
    capture (with its type and ``split_points``), and the ties.

    Example:
        >>> values = setup_values(PipelineConfig(balance=[1, 3]), [nn.ReLU] * 4,
        ...                       capturing=False, split_points=None, ties=())
        >>> values["PipelineConfig.balance"], values["len(layers)"], "PipelineConfig.timeout" in values
        ([1, 3], 4, False)
    """
    values: dict[str, Any] = {}
    for f in fields(config):
        if f.init and f.name not in MAY_DIFFER and f.name != "extra_problems":
            value = getattr(config, f.name)
            values[f"PipelineConfig.{f.name}"] = (
                _schedule_value(config) if f.name == "schedule" else value)
    if capturing:
        values["type(model)"] = type(layers).__name__
        if isinstance(layers, nn.Module):
            values["the model's parameters and buffers"] = model_tensors(layers)
        values["split_points"] = None if split_points is None else list(split_points)
    else:
        values["len(layers)"] = len(layers)
        if isinstance(layers, nn.Sequential):
            values["the layers' parameters and buffers"] = model_tensors(layers)
    values["ties"] = [list(tie) for tie in ties]
    return values


def batch_values(inputs: Any, targets: Any) -> dict[str, Any]:
    """What every rank's batch of a training step must share: its size, and its inputs
    and targets (the ranks compare their tensors' shapes and dtypes, and any other value
    itself).

    Example:
        >>> import torch
        >>> from pipetrain.api.agreement import shown
        >>> {key: shown(value) for key, value in batch_values(torch.zeros(8, 3), None).items()}
        {"train_step's batch size": '8', "train_step's inputs": '(8, 3) float32', "train_step's targets": 'None'}
    """
    try:
        size: int | None = batch_size(inputs)
    except ValueError:
        size = None  # refused by the step itself, alike on every rank
    return {"train_step's batch size": size, "train_step's inputs": inputs,
            "train_step's targets": targets}


def refuse_setup_disagreement(config: PipelineConfig, layers: Any, *, capturing: bool,
                              split_points: Sequence[str] | None, ties: Sequence[Tie]) -> None:
    """Refuse on every rank a set-up (:func:`setup_values`) that is not the same on
    every rank (every rank calls it; nothing outside a job).

    Raises:
        DisagreementError: as :func:`~pipetrain.api.agreement.refuse_disagreement`.
    """
    refuse_disagreement(setup_values(config, layers, capturing=capturing,
                                     split_points=split_points, ties=ties),
                        what="the Pipeline's set-up", fix=SETUP_FIX)


def refuse_batch_disagreement(inputs: Any, targets: Any) -> None:
    """Refuse on every rank a training batch (:func:`batch_values`) that is not the same
    on every rank (every rank calls it).

    Raises:
        DisagreementError: as :func:`~pipetrain.api.agreement.refuse_disagreement`.
    """
    refuse_disagreement(batch_values(inputs, targets), what="the first train_step's batch",
                        fix="every rank passes the same global batch to train_step")


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


def job_mesh(config: PipelineConfig, layout: Layout, *, pipeline_rank: int, device: torch.device,
             mesh: DeviceMesh | None) -> tuple[DeviceMesh | None, Any]:
    """The job's mesh (the user's, checked, or one built; ``None`` when the stages have
    different replica counts) and this rank's replica group (the mesh's ``dp`` group).
    Every rank calls it: it creates process groups.

    Example (in each of 4 processes)::

        mesh, dp_group = job_mesh(config, layout, pipeline_rank=0, device=torch.device("cpu"),
                                  mesh=None)
        mesh.mesh_dim_names   # ('pp', 'dp', 'tp')
    """
    if mesh is not None:
        check_mesh(mesh, config)
    elif layout.uniform:
        mesh = build_mesh(config, device=device)
    if mesh is None:
        return None, replica_group(layout, pipeline_rank=pipeline_rank)
    return mesh, mesh.get_group("dp")


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


def layout_link_groups(layout: Layout, *, rank: int) -> dict[tuple[int, int], Any]:
    """This rank's groups of :func:`~pipetrain.runtime.links.link_groups` (GPUs: one
    group per direction of each link): every rank creates those of every tensor-parallel
    index's placement, in the same order (a collective).

    Example (in each process of a job)::

        layout_link_groups(layout, rank=dist.get_rank())   # {(src, dst): group, ...}
    """
    mine: dict[tuple[int, int], Any] = {}
    for t in range(layout.tensor_parallel):
        placement = dataclasses.replace(layout, tp_index=t).placement()
        mine |= link_groups(placement, rank=rank)
    return mine


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
        data_groups=layout_link_groups(layout, rank=rank) if on_device else {},
        device=device,
        check=monitor.check if monitor is not None else None,
        explain=monitor.explain if monitor is not None else None,
    )
