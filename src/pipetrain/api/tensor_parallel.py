"""Tensor parallelism on the mesh's ``tp`` dimension: a plan applied to each layer of a stage.

With ``PipelineConfig(tensor_parallel=T)`` every (stage, replica) position of the pipeline
is ``T`` processes, and the layers of their stages are split between them by
:func:`torch.distributed.tensor.parallel.parallelize_module` over the position's ``tp``
group. A plan is a function ``plan(layer_index, layer, tp_mesh)`` that parallelizes one
layer in place (:data:`TensorParallelPlan`); :func:`styles_plan` makes one from
``parallelize_module``'s own plan (submodule name -> ``ColwiseParallel()`` /
``RowwiseParallel()`` ...), applied to every layer that has those submodules.

A layer must take and return whole (replicated) activations: they cross stages between
the ranks of the same tensor-parallel index, each a copy. Parameters a plan leaves alone
(embeddings, norms) are copies on every ``tp`` rank with the same gradients; the global
gradient norm counts them once (:mod:`pipetrain.api.grad_check`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

__all__ = [
    "TensorParallelPlan",
    "apply_plan",
    "local_tensor",
    "parallelize_stages",
    "styles_plan",
    "tensor_parallel_copies",
]

TensorParallelPlan = Callable[[int, nn.Module, DeviceMesh], None]
"""``plan(layer_index, layer, tp_mesh)``: parallelize one layer in place over ``tp_mesh``
(every ``tp`` rank calls it alike for the same layer)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local tensor: its shard, or its copy);
    any other tensor itself.

    Example:
        >>> local_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def styles_plan(styles: Mapping[str, ParallelStyle]) -> TensorParallelPlan:
    """A plan that gives every layer holding all the submodules ``styles`` names those
    styles (``parallelize_module(layer, tp_mesh, dict(styles))``), and leaves the others.
    A name may hold ``*`` wildcards, as ``parallelize_module``'s plans do
    (``"blocks.*.mlp.fc"``: the units of a captured model keep the model's names).

    Example::

        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        plan = styles_plan({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    """
    names = dict(styles)

    def plan(index: int, layer: nn.Module, mesh: DeviceMesh) -> None:
        submodules = [name for name, _ in layer.named_modules()]
        if all(any(fnmatch.fnmatchcase(m, name) for m in submodules) for name in names):
            parallelize_module(layer, mesh, dict(names))

    return plan


def apply_plan(layers: Mapping[int, nn.Module], plan: TensorParallelPlan, *, mesh: DeviceMesh) -> None:
    """Parallelize this rank's ``layers`` (by global index, in order) with ``plan`` over
    ``mesh`` (the ``tp`` sub-mesh).

    Example (in each process of a tensor-parallel job)::

        apply_plan({3: block, 4: head}, gpt_tensor_parallel_plan, mesh=mesh["tp"])
    """
    for index in sorted(layers):
        plan(index, layers[index], mesh)


def parallelize_stages(layers: Mapping[int, nn.Module], plan: TensorParallelPlan | None, *,
                       mesh: DeviceMesh | None, tensor_parallel: int,
                       ties: Iterable[Sequence[tuple[int, str]]] = (), captured: bool = False) -> None:
    """Apply ``plan`` to this rank's ``layers`` over the ``tp`` dimension of the job's
    ``mesh`` when ``tensor_parallel > 1`` (every rank calls it).

    Raises:
        ValueError: ``tensor_parallel > 1`` without a plan or with a ``captured`` model, or
            a plan with ``tensor_parallel == 1`` (every rank alike); a plan that split a
            weight of ``ties`` (tied copies are summed whole across stages).

    Example (in each process of a job with ``tensor_parallel=2``)::

        parallelize_stages(layers, gpt_tensor_parallel_plan, mesh=mesh, tensor_parallel=2)
    """
    if tensor_parallel == 1:
        if plan is not None:
            raise ValueError("a tensor_parallel_plan was given but the configuration has "
                             "tensor_parallel=1; fix: PipelineConfig(tensor_parallel=2) (or "
                             "more), or no plan")
        return
    if captured:
        raise ValueError(f"tensor_parallel={tensor_parallel} with a captured model: its units "
                         "run the model's graph, and parallelize_module splits nn.Linear and "
                         "nn.Embedding modules, which the units do not call; fix: the model as "
                         "layer factories or an nn.Sequential of its layers, or "
                         "tensor_parallel=1")
    if plan is None:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs a plan that splits the "
                         "layers; fix: Pipeline(..., tensor_parallel_plan=styles_plan("
                         "{'fc': ColwiseParallel(), 'proj': RowwiseParallel()})) naming your "
                         "layers' linear submodules (see pipetrain.api.tensor_parallel)")
    assert mesh is not None  # one replica count everywhere (config_problems)
    apply_plan(layers, plan, mesh=mesh["tp"])
    for tie in ties:
        for i, name in tie:
            if i in layers and isinstance(layers[i].get_parameter(name), DTensor):
                raise ValueError(f"the tensor_parallel_plan split layer {i}'s {name!r}, a weight "
                                 f"tied across layers ({tuple(tie)}); fix: a plan that leaves "
                                 "tied weights whole (as the GPT's leaves its embedding and head)")


def tensor_parallel_copies(tensor: Any, tensor_parallel: int) -> int:
    """On how many ranks of a ``tp`` group the same values of ``tensor`` (a gradient) are:
    1 for a DTensor sharded over ``tp``, ``tensor_parallel`` for a tensor every ``tp`` rank
    holds alike (a parameter the plan left alone, also when FSDP shards it over ``dp``, or
    a DTensor replicated over ``tp``).

    Example:
        >>> import torch
        >>> tensor_parallel_copies(torch.zeros(2), 4)
        4
    """
    names = tensor.device_mesh.mesh_dim_names if isinstance(tensor, DTensor) else None
    if names is None or "tp" not in names:  # a plain tensor, or sharded over dp only
        return tensor_parallel
    return 1 if tensor.placements[names.index("tp")].is_shard() else tensor_parallel
