"""The job's mesh: pipeline (``pp``) x data-parallel (``dp``) x tensor-parallel (``tp``) ranks.

A job of ``P`` pipeline ranks, ``D`` data-parallel ranks and ``T`` tensor-parallel ranks
(``world = P * D * T``) is one :class:`torch.distributed.device_mesh.DeviceMesh` of shape
``(P, D, T)`` with dimensions named ``("pp", "dp", "tp")``, ``tp`` innermost, as
torchtitan lays it out. Global rank ``g`` is pipeline rank ``g // (D * T)``, replica
``(g // T) % D``, tensor-parallel index ``g % T``; with ``T = 1`` that is
:class:`~pipetrain.api.layout.Layout`'s ``g // D``, ``g % D``.

The ``dp`` dimension either replicates each stage (``data_parallel="replicate"``: the
gradients are all-reduced by the schedule's ``REDUCE`` actions) or shards it with FSDP2
(``data_parallel="fsdp"``: see :mod:`pipetrain.api.fsdp`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DATA_PARALLEL_MODES",
    "MESH_DIM_NAMES",
    "SPLIT_BACKWARD_SCHEDULES",
    "build_mesh",
    "check_mesh",
    "mesh_problems",
    "mesh_record",
    "mesh_shape",
]

DATA_PARALLEL_MODES = ("replicate", "fsdp")
"""How the ``dp`` ranks hold a stage: whole copies, or FSDP2 shards."""

MESH_DIM_NAMES = ("pp", "dp", "tp")
"""The mesh's dimensions, outermost first."""

SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v")
"""The schedules that split a backward into its input half and its weight half."""


def mesh_shape(config: Any) -> tuple[int, int, int]:
    """``(P, D, T)`` of a :class:`~pipetrain.api.config.PipelineConfig` with the same
    replica count on every pipeline rank.

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> mesh_shape(PipelineConfig(num_stages=2, replicas=2))
        (2, 2, 1)
    """
    return (config.num_stages, config.replicas, config.tensor_parallel)


def mesh_record(config: Any) -> dict[str, Any]:
    """What a run's records say of its mesh: the sizes by dimension, the world, and how
    the ``dp`` ranks hold a stage.

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> mesh_record(PipelineConfig(num_stages=2, replicas=2, data_parallel="fsdp"))
        {'pp': 2, 'dp': 2, 'tp': 1, 'world_size': 4, 'data_parallel': 'fsdp', 'reshard_after_forward': False, 'reduce_each_microbatch': False}
    """
    holding = {"data_parallel": config.data_parallel,
               "reshard_after_forward": config.reshard_after_forward,
               "reduce_each_microbatch": config.reduce_each_microbatch}
    if config.stage_replicas is not None and len(set(config.stage_replicas)) > 1:
        return {"pp": config.num_stages, "dp": list(config.stage_replicas), "tp": 1,
                "world_size": config.world_size, **holding}
    pp, dp, tp = config.num_stages, config.replica_counts[0], config.tensor_parallel
    return {"pp": pp, "dp": dp, "tp": tp, "world_size": pp * dp * tp, **holding}


def build_mesh(config: Any, *, device: torch.device) -> DeviceMesh:
    """The job's mesh (every rank calls it: it creates the process groups of each
    dimension), on ``device``'s type (``cpu`` with gloo, ``cuda`` with NCCL).

    Example (in each of 4 processes)::

        mesh = build_mesh(PipelineConfig(num_stages=2, replicas=2), device=torch.device("cpu"))
        mesh["dp"].get_group()   # this pipeline rank's replicas
    """
    return init_device_mesh(device.type, mesh_shape(config), mesh_dim_names=MESH_DIM_NAMES)


def check_mesh(mesh: DeviceMesh, config: Any) -> None:
    """Refuse a mesh the user built that is not the configuration's layout.

    Raises:
        ValueError: its dimension names, its shape or its ranks differ (the message shows
            the mesh to build).

    Example (in each process of the job)::

        check_mesh(init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp")),
                   PipelineConfig(num_stages=2, replicas=2))
    """
    shape = mesh_shape(config)
    fix = (f"fix: init_device_mesh(device_type, {shape}, mesh_dim_names={MESH_DIM_NAMES}), or "
           "no mesh (the Pipeline builds it)")
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_DIM_NAMES:
        raise ValueError(f"the mesh's dimensions are {names}, not {MESH_DIM_NAMES}; {fix}")
    if tuple(mesh.mesh.shape) != shape:
        raise ValueError(f"the mesh has shape {tuple(mesh.mesh.shape)} but the configuration "
                         f"needs (num_stages, replicas, tensor_parallel) = {shape}; {fix}")
    expected = torch.arange(shape[0] * shape[1] * shape[2]).reshape(shape)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise ValueError(f"the mesh's ranks are {mesh.mesh.tolist()}; the pipeline needs global "
                         f"rank g at pipeline rank g // (D * T), replica (g // T) % D, "
                         f"tensor-parallel index g % T; {fix}")


def _tensor_parallel_problems(values: Mapping[str, Any], name: str,
                              say: Callable[[str, Any], str]) -> list[str]:
    """What ``tensor_parallel > 1`` cannot run with (not available yet, or never)."""
    from pipetrain.schedule import ASYNC_SCHEDULES

    tp = values["tensor_parallel"]
    found: list[str] = []
    counts = values["stage_replicas"]
    if counts is not None and len(set(counts)) > 1:
        found.append(f"{say('tensor_parallel', tp)} needs the same number of replicas on every "
                     f"stage (one mesh), got {say('stage_replicas', tuple(counts))}; fix: "
                     f"{say('replicas', max(counts))} or {say('tensor_parallel', 1)}")
    unavailable = []
    if values.get("mixed_precision") is not None:
        unavailable.append(say("mixed_precision", values["mixed_precision"]))
    if name in ASYNC_SCHEDULES:
        unavailable.append(f"schedule {name!r}")
    if unavailable:
        found.append(f"{say('tensor_parallel', tp)} with {' and '.join(unavailable)} is not "
                     f"available yet; fix: {say('tensor_parallel', 1)}, or "
                     f"{say('schedule', '1f1b')} with replicated float32 stages")
    return found


def mesh_problems(values: Mapping[str, Any], name: str,
                  say: Callable[[str, Any], str]) -> list[str]:
    """The problems of the :class:`~pipetrain.api.config.PipelineConfig` fields ``values``
    that concern the mesh (``name``: the schedule's canonical name, ``""`` for a user
    schedule or an unknown name), each with its fix.

    Example:
        >>> mesh_problems({"data_parallel": "zero", "tensor_parallel": 1, "replicas": 2,
        ...                "reshard_after_forward": False, "reduce_each_microbatch": False,
        ...                "stage_replicas": None,
        ...                "mixed_precision": None}, "1f1b", lambda n, v: f"{n}={v!r}")
        ["data_parallel='zero' must be one of replicate, fsdp, e.g. data_parallel='fsdp'"]
    """
    from pipetrain.schedule import ASYNC_SCHEDULES

    found: list[str] = []
    mode = values["data_parallel"]
    if mode not in DATA_PARALLEL_MODES:
        found.append(f"{say('data_parallel', mode)} must be one of "
                     f"{', '.join(DATA_PARALLEL_MODES)}, e.g. {say('data_parallel', 'fsdp')}")
    tp = values["tensor_parallel"]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        found.append(f"{say('tensor_parallel', tp)} must be a positive integer, e.g. "
                     f"{say('tensor_parallel', 1)}")
    elif tp > 1:
        found.extend(_tensor_parallel_problems(values, name, say))
    for option in ("reshard_after_forward", "reduce_each_microbatch"):
        value = values[option]
        if not isinstance(value, bool):
            found.append(f"{say(option, value)} must be True or False")
        elif value and mode != "fsdp":
            found.append(f"{say(option, True)} is an FSDP option; fix: "
                         f"{say('data_parallel', 'fsdp')} or {say(option, False)}")
    if mode != "fsdp":
        return found
    counts = values["stage_replicas"]
    if counts is not None and len(set(counts)) > 1:
        found.append(f"{say('data_parallel', 'fsdp')} shards every stage over the same number of "
                     f"replicas (one mesh), got {say('stage_replicas', tuple(counts))}; fix: "
                     f"{say('replicas', max(counts))} or {say('data_parallel', 'replicate')}")
    if name in ASYNC_SCHEDULES:
        found.append(f"{say('data_parallel', 'fsdp')}: schedule {name!r} keeps several weight "
                     "versions of a stage and updates it between micro-batches, which FSDP's one "
                     "sharded copy, gathered and reduced once per step, cannot hold; fix: a "
                     f"synchronous schedule, e.g. {say('schedule', '1f1b')}, or "
                     f"{say('data_parallel', 'replicate')}")
    if name in SPLIT_BACKWARD_SCHEDULES:
        found.append(f"{say('data_parallel', 'fsdp')}: schedule {name!r} splits each backward "
                     "into an input half and a later weight half, and FSDP reduce-scatters a "
                     "module's gradients from its own hook when the input half passes it, "
                     "before the weight half has computed them; fix: "
                     f"{say('schedule', '1f1b')}, {say('schedule', 'interleaved-1f1b')} or "
                     f"{say('data_parallel', 'replicate')}")
    if values.get("mixed_precision") is not None:
        found.append(f"{say('data_parallel', 'fsdp')} with "
                     f"{say('mixed_precision', values['mixed_precision'])} is not available yet; "
                     f"fix: {say('mixed_precision', None)} or {say('data_parallel', 'replicate')}")
    return found
