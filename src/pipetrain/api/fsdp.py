"""FSDP2 on the mesh's ``dp`` dimension: each stage's layers ``fully_shard``-ed over its replicas.

With ``PipelineConfig(data_parallel="fsdp")`` every layer of this rank's stages that has
parameters is one :func:`torch.distributed.fsdp.fully_shard` unit over the ``dp`` group of
its pipeline rank (each layer its own root: the runtime calls the layers one by one; a tie
whose copies meet on one rank is refused, :func:`refuse_local_ties`). Its
parameters, their gradients and the optimizer's state are then DTensors sharded over the
replicas; FSDP's own hooks gather the parameters before a forward and reduce-scatter the
gradients after a backward. When is a matter of the schedule: its ``UNSHARD``,
``REDUCE`` and ``RESHARD`` actions (:func:`pipetrain.schedule.add_fsdp_actions`), which the
simulator prices and the timeline and trace show:

- **once per step** (the default): a stage's ``UNSHARD`` starts the all-gather of its
  parameters one compute action before the stage's first, the parameters stay gathered
  across the step's micro-batches (the backwards accumulate into gathered gradients, with
  no reduction: ``set_requires_gradient_sync(False)``), its ``REDUCE`` reduce-scatters the
  gradients (summed: pipetrain's loss already weighs each micro-batch by its share of the
  global batch) and its ``RESHARD`` frees the gathered copy before the optimizer step.
- with ``reshard_after_forward`` (less memory): FSDP's own hooks gather each layer in
  every forward and backward that uses it and free it after, so a stage never holds more
  than one gathered layer; there is no ``UNSHARD`` / ``RESHARD`` action, and ``REDUCE``
  reduce-scatters as above. Where replicas run different numbers of micro-batches (a
  smaller last batch) the step gathers once instead (each gather is a collective of all
  replicas).
- with ``reduce_each_microbatch``: each backward reduce-scatters the gradients it made
  (FSDP's own post-backward) and FSDP accumulates them sharded, so a stage never holds a
  whole gradient between micro-batches (with ``reshard_after_forward`` as well, a worker
  keeps only shards: parameters, gradients and optimizer state); ``REDUCE`` then has
  nothing left to do. A step whose replicas run different numbers of micro-batches
  reduces at ``REDUCE`` instead.
- **every replica in step**: FSDP's collectives run on every replica of a stage at the same
  point of its action list (the replicas of a stage run the same program on their own
  micro-batches). An evaluation gathers every unit once, explicitly, on every replica (one
  may have no micro-batch).

FSDP has no public call that reduce-scatters outside an autograd backward; ``REDUCE`` runs
FSDP's post-backward for the stage's units, as ``torch.distributed.pipelining`` does for its
own ``REDUCE_GRAD`` action (:func:`reduce_now`), and the switches above are FSDP's public
ones. FSDP computes each gathered gradient through autograd, so the fused weight-gradient
backward (:mod:`pipetrain.backward.fused`, which writes ``.grad`` of the parameters the
stage held when it was built) is off under FSDP, and the schedules that split backwards
into input and weight halves are refused (:mod:`pipetrain.api.mesh`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import Layout
from pipetrain.api.optimizer_step import TiedParameter
from pipetrain.runtime.stage import StageCompute
from pipetrain.schedule import Action, Op

__all__ = [
    "ShardedStages",
    "reduce_now",
    "refuse_local_ties",
    "shard_stages",
    "shared_units",
    "whole_tensors",
]


def whole_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each DTensor gathered whole (a collective of its mesh: every rank
    holding it calls this with the same keys in the same order).

    Example:
        >>> whole_tensors({"w": torch.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def shared_units(layers: Mapping[int, nn.Module]) -> list[list[int]]:
    """The layers with parameters grouped by shared parameters: layers that share one
    (a tie whose copies are on this rank) in one group, each other layer alone.

    Example:
        >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> b.weight = a.weight
        >>> shared_units({0: a, 1: nn.ReLU(), 2: b, 3: nn.Linear(2, 2)})
        [[0, 2], [3]]
    """
    owner: dict[int, int] = {}  # parameter id -> first layer holding it
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, layer in layers.items():
        params = list(layer.parameters())
        if not params:
            continue
        parent[i] = i
        for p in params:
            if id(p) in owner:
                parent[root(i)] = root(owner[id(p)])
            else:
                owner[id(p)] = i
    units: dict[int, list[int]] = {}
    for i in parent:
        units.setdefault(root(i), []).append(i)
    return sorted(units.values())


def refuse_local_ties(ties: Iterable[Sequence[tuple[int, str]]], *,
                      stage_to_rank: Sequence[int], layer_ranges: Sequence[range]) -> None:
    """Refuse a tie with two copies on one pipeline rank (every rank decides alike).

    Such copies are one parameter of two layers; the runtime calls the layers one by one,
    each as its own FSDP root, and FSDP cannot shard one parameter in two roots.

    Raises:
        ValueError: naming the tie, the rank and the fixes.

    Example:
        >>> refuse_local_ties([((0, "w"), (3, "w"))], stage_to_rank=(0, 1),
        ...                   layer_ranges=(range(0, 2), range(2, 4)))
        >>> refuse_local_ties([((0, "w"), (3, "w"))], stage_to_rank=(0,),
        ...                   layer_ranges=(range(0, 4),))
        Traceback (most recent call last):
        ...
        ValueError: data_parallel='fsdp': tie ((0, 'w'), (3, 'w')) has 2 copies on pipeline rank 0, ...
    """
    for tie in ties:
        ranks = [stage_to_rank[j] for i, _ in tie for j, r in enumerate(layer_ranges) if i in r]
        for rank in dict.fromkeys(ranks):
            if ranks.count(rank) > 1:
                raise ValueError(
                    f"data_parallel='fsdp': tie {tuple(tie)} has {ranks.count(rank)} copies on "
                    f"pipeline rank {rank}, one parameter of several layers, and each layer is "
                    "its own FSDP unit (FSDP cannot shard one parameter in two); fix: more "
                    "stages, so that the copies land on different ranks (e.g. num_stages=2 "
                    "with a schedule that does not fold the last stage back onto the first "
                    "rank), untied weights, or data_parallel='replicate'")


def _post_backward_of(unit: FSDPModule) -> tuple[list[Any], Callable[[], None]]:
    """FSDP2's post-backward of ``unit``: its parameter groups and its root's final
    callback (internals of FSDP2 that ``torch.distributed.pipelining`` calls too).

    Raises:
        RuntimeError: this torch's FSDP2 lacks them (the message names the fix).
    """
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before FSDP2 allowed several groups per module
        groups = [getattr(state, "_fsdp_param_group", None)]
    groups = [g for g in groups if g is not None]
    finish = getattr(state, "_root_post_backward_final_callback", None)
    if finish is None or not all(hasattr(g, "post_backward") for g in groups):
        raise RuntimeError(
            f"data_parallel='fsdp': torch {torch.__version__}'s FSDP2 has no post-backward "
            "that pipetrain can run for a REDUCE action (the one torch.distributed.pipelining "
            "runs); fix: a torch release pipetrain supports (see its requirements), or "
            "data_parallel='replicate'")
    return groups, finish


def reduce_now(unit: FSDPModule) -> None:
    """Reduce-scatter the gradients ``unit``'s backwards accumulated (a collective of its
    mesh: every replica calls it at the same point), outside an autograd backward.

    FSDP2 runs this from its post-backward hook; ``torch.distributed.pipelining`` calls the
    same internals for its ``REDUCE_GRAD`` action, which is what this does.

    Raises:
        RuntimeError: this torch's FSDP2 lacks them (the message names the fix).

    Example (in each process of a 2-replica job, after the step's backwards)::

        for unit in sharded.stage_units[0]:
            reduce_now(unit)
    """
    groups, finish = _post_backward_of(unit)
    unit.set_requires_gradient_sync(True, recurse=False)
    unit.set_is_last_backward(True)
    for group in groups:
        group.post_backward()
    finish()
    unit.set_requires_gradient_sync(False, recurse=False)
    unit.set_is_last_backward(False)


def _share_reduce_buffers(unit: FSDPModule, shared: list[Any]) -> None:
    """Have ``unit`` keep its reduce-scatter input buffers in ``shared``, the list of all
    this rank's units, as the units of one FSDP root do: each reduce-scatter then frees
    the one before it (FSDP keeps one in flight), instead of every unit (each its own root
    here) keeping its own until the end of the backward. A torch whose FSDP2 keeps them
    otherwise is left as it is."""
    context: Any = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
    if isinstance(getattr(context, "reduce_scatter_states", None), list):
        context.reduce_scatter_states = shared


class ShardedStages:
    """This rank's layers sharded with FSDP2 over ``mesh`` (the ``dp`` sub-mesh), and
    the per-step switches of :mod:`this module <pipetrain.api.fsdp>`.

    ``stage_layers`` lists the layers of each local stage. Building it replaces the
    layers' parameters by sharded ones: :meth:`replaced` maps an old parameter to its new
    one.

    Example (in each process of a 2-replica job)::

        sharded = ShardedStages(layers, stage_layers={0: [0, 1]}, mesh=mesh["dp"],
                                reshard_after_forward=False)
        sharded.plan(actions)          # before a step
        sharded.unshard(0)             # the step's 0UNSHARD action
        sharded.before_backward(0, 3)  # the stage's backward of micro-batch 3
        sharded.reduce(0)              # 0REDUCE
        sharded.reshard(0)             # 0RESHARD
    """

    def __init__(self, layers: Mapping[int, nn.Module], *, stage_layers: Mapping[int, Sequence[int]],
                 mesh: DeviceMesh, reshard_after_forward: bool) -> None:
        before = {(i, name): p for i, layer in layers.items()
                  for name, p in layer.named_parameters(remove_duplicate=False)}
        self.reshard_after_forward = reshard_after_forward
        self.units: list[FSDPModule] = []
        unit_of_layer: dict[int, FSDPModule] = {}
        for unit in shared_units(layers):
            if len(unit) > 1:
                raise ValueError(f"data_parallel='fsdp': layers {unit} share a parameter, and "
                                 "FSDP cannot shard one parameter in two units; fix: layers "
                                 "that share no parameter, or data_parallel='replicate'")
            module = layers[unit[0]]
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
            assert isinstance(module, FSDPModule)
            # a unit is its own root (the runtime calls layers one by one): say explicitly
            # what FSDP would otherwise decide for a root
            module.set_reshard_after_forward(reshard_after_forward)
            module.set_gradient_divide_factor(1.0)  # a sum: the losses are weighted already
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
            _post_backward_of(module)  # REDUCE can run: refused now, not in a step
            self.units.append(module)
            for i in unit:
                unit_of_layer[i] = module
        self._replaced = {id(p): layers[i].get_parameter(name) for (i, name), p in before.items()}
        self.stage_units: dict[int, list[FSDPModule]] = {
            j: list(dict.fromkeys(unit_of_layer[i] for i in indices if i in unit_of_layer))
            for j, indices in stage_layers.items()
        }
        self._gathered = False  # the step's actions gather the stages (UNSHARD)
        self._each_microbatch = False  # the step's backwards reduce-scatter (not REDUCE)
        self._reduce_buffers: list[Any] = []  # FSDP's retained reduce-scatter inputs, shared

    def replaced(self, param: nn.Parameter) -> nn.Parameter:
        """The sharded parameter that replaced ``param`` (``param`` if it was not sharded)."""
        return self._replaced.get(id(param), param)

    def plan(self, actions: Iterable[Action], *, each_microbatch: bool = False) -> None:
        """Set the switches for a step of this rank's ``actions``: with their ``UNSHARD``
        actions the parameters stay gathered from the stage's ``UNSHARD`` to its
        ``RESHARD``; without, FSDP gathers and frees each layer in each forward and
        backward (``reshard_after_forward``). The backwards accumulate the gradients and
        ``REDUCE`` reduce-scatters them, or with ``each_microbatch`` every backward
        reduce-scatters its own and FSDP accumulates them sharded."""
        self._gathered = any(a.op is Op.UNSHARD for a in actions)
        self._each_microbatch = each_microbatch
        for unit in self.units:
            unit.set_reshard_after_forward(self.reshard_after_forward and not self._gathered)

    def before_backward(self, stage: int, key: int) -> None:
        """Set the switches of the stage's units for a backward (of micro-batch ``key``):
        accumulate the gradients, or reduce-scatter them (see :meth:`plan`; each backward
        then waits for its reductions and frees their buffers: the option is for memory),
        and free the gathered parameters after it only when the step does not keep them
        gathered."""
        for unit in self.stage_units.get(stage, ()):
            unit.set_requires_gradient_sync(self._each_microbatch, recurse=False)
            unit.set_is_last_backward(self._each_microbatch)
            unit.set_reshard_after_backward(not self._gathered, recurse=False)
            if self._each_microbatch:
                _share_reduce_buffers(unit, self._reduce_buffers)

    def unshard(self, stage: int) -> None:
        """``UNSHARD``: start gathering the stage's parameters (FSDP waits for them before
        the units' next forward or backward)."""
        for unit in self.stage_units.get(stage, ()):
            unit.unshard(async_op=True)

    def reduce(self, stage: int) -> None:
        """``REDUCE``: reduce-scatter the gradients the stage's backwards accumulated
        (:func:`reduce_now`); nothing when each backward reduced its own."""
        if self._each_microbatch:
            return
        for unit in self.stage_units.get(stage, ()):
            reduce_now(unit)

    def reshard(self, stage: int) -> None:
        """``RESHARD``: free the stage's gathered parameters (no communication)."""
        for unit in self.stage_units.get(stage, ()):
            unit.reshard()

    def gather(self, *, keep: bool) -> None:
        """Gather every unit's parameters now (every replica calls it, in the same order);
        with ``keep`` the forwards that follow keep them gathered (an evaluation)."""
        for unit in self.units:
            if keep:
                unit.set_reshard_after_forward(False)
            unit.unshard()

    def release(self) -> None:
        """Free every unit's gathered parameters (no communication) and restore the
        configured policy; the units then hold only their shards."""
        for unit in self.units:
            unit.reshard()
            unit.set_reshard_after_forward(self.reshard_after_forward)
        self._gathered = False
        self._each_microbatch = False

    def attach(self, stages: Iterable[StageCompute]) -> None:
        """Have ``stages`` call :meth:`before_backward` before each backward."""
        for stage in stages:
            stage.before_backward = self.before_backward

    @contextlib.contextmanager
    def training(self, actions: Iterable[Action], *, each_microbatch: bool = False) -> Iterator[None]:
        """A training step's block: :meth:`plan` before, :meth:`release` after (also
        after a failure)."""
        self.plan(actions, each_microbatch=each_microbatch)
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """An evaluation's block: every unit gathered once on entry (every replica, also
        one without a micro-batch), released on exit."""
        try:
            self.gather(keep=True)
            yield
        finally:
            self.release()



def shard_stages(layers: Mapping[int, nn.Module], tied: Sequence[TiedParameter], *,
                 ties: Iterable[Sequence[tuple[int, str]]], mesh: DeviceMesh | None,
                 config: PipelineConfig, layout: Layout) -> tuple[ShardedStages, list[TiedParameter]]:
    """Shard this rank's ``layers`` over the ``dp`` dimension of the job's ``mesh``
    (:class:`ShardedStages`, every rank calls it); the cross-rank ``tied`` copies with
    their sharded parameters.

    Raises:
        ValueError: a tie of ``ties`` has copies on one rank (:func:`refuse_local_ties`).

    Example (in each process of a job with ``data_parallel="fsdp"``)::

        sharded, tied = shard_stages(layers, tied, ties=ties, mesh=mesh, config=config,
                                     layout=layout)
    """
    refuse_local_ties(ties, stage_to_rank=layout.stage_to_rank, layer_ranges=layout.layer_ranges)
    assert mesh is not None  # one replica count everywhere (config_problems)
    pipeline_rank = layout.stage_to_rank[next(j for j, r in enumerate(layout.layer_ranges)
                                              if r.start in layers)]
    sharded = ShardedStages(layers, mesh=mesh["dp"], reshard_after_forward=config.reshard_after_forward,
                            stage_layers={j: list(layout.layer_ranges[j])
                                          for j in layout.stages_of(pipeline_rank)})
    return sharded, [dataclasses.replace(t, param=sharded.replaced(t.param)) for t in tied]
