"""The pipeline layout: which layers each stage holds, where each stage lives, ties.

Every process computes the same layout from the configuration, so no process needs to
see the whole model: a rank builds only the layers of its own stages (from layer
factories), named by their global layer index, so parameter names (``layers.5.weight``)
do not depend on the number of stages (checkpoints reshard).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from pipetrain.api.config import PipelineConfig
from pipetrain.partition import verify_balance
from pipetrain.runtime.transport import ACTIVATION, GRADIENT, Channel, Placement
from pipetrain.schedule.replicated import replica_ranks

__all__ = ["LayerSource", "Layout", "StageModule", "Tie"]

LayerSource = Sequence[Callable[[], nn.Module]] | nn.Sequential
"""Layer factories (each builds one layer, the same weights wherever it is called) or an
``nn.Sequential`` (every process then holds the whole model)."""

Tie = tuple[tuple[int, str], ...]
"""Tied parameters as ``((layer index, parameter name in the layer), ...)``."""


@dataclass(frozen=True)
class Layout:
    """Stages, ranks and replicas of one job (the same on every process).

    Pipeline rank ``p`` (which holds model stages ``stages_of(p)``) has
    ``replica_counts[p]`` data-parallel replicas, on consecutive global ranks: pipeline
    rank 0's replicas first. With the same count ``D`` everywhere, global rank ``g`` is
    pipeline rank ``g // D``, replica ``g % D``. Micro-batch ``i`` of a stage runs on
    replica ``i % D`` of its pipeline rank (:meth:`placement`).

    With ``tensor_parallel = T > 1`` every (pipeline rank, replica) position is ``T``
    processes, global ranks ``r * T + t`` for position ``r`` (as above) and tensor-parallel
    index ``t`` (the mesh's ``tp``, innermost). The layout of index ``tp_index`` names the
    ranks of that index only: its stages exchange activations with the ranks of the same
    index, each index a pipeline of its own (:mod:`pipetrain.api.mesh`).

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> layout = Layout.create(PipelineConfig(num_stages=2, replicas=2), num_layers=4)
        >>> layout.layer_ranges
        (range(0, 2), range(2, 4))
        >>> layout.global_rank(pipeline_rank=1, replica=0)
        2
        >>> uneven = Layout.create(PipelineConfig(num_stages=2, stage_replicas=(2, 1)), num_layers=4)
        >>> uneven.position(2), uneven.placement().rank(0, 3), uneven.world_size
        ((1, 0), 1, 3)
        >>> v = Layout.create(PipelineConfig(schedule="zb-v", num_stages=2, stages_per_rank=2),
        ...                   num_layers=8)
        >>> v.stage_to_rank, v.stages_of(0), v.layer_ranges[3]
        ((0, 1, 1, 0), (0, 3), range(6, 8))
    """

    num_stages: int
    """Pipeline ranks per replica."""
    stage_to_rank: tuple[int, ...]
    """Pipeline rank of each model stage."""
    layer_ranges: tuple[range, ...]
    """Layers of each model stage."""
    replica_counts: tuple[int, ...]
    """Replicas of each pipeline rank."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks of every position (``T``)."""
    tp_index: int = 0
    """The tensor-parallel index whose ranks this layout names."""

    @staticmethod
    def create(config: PipelineConfig, *, num_layers: int, tp_index: int = 0) -> Layout:
        """The layout of ``num_layers`` layers under ``config`` (the ranks of tensor-parallel
        index ``tp_index``)."""
        num_model_stages = config.num_model_stages
        if config.balance is None:
            if num_model_stages > num_layers:
                raise ValueError(
                    f"more stages than layers: {num_model_stages} stages "
                    f"({config.num_stages} ranks x {config.stages_per_rank} stages per rank) "
                    f"for {num_layers} layers; fix: use at most {num_layers} stages, e.g. "
                    f"num_stages={max(1, num_layers // config.stages_per_rank)}"
                )
            base, extra = divmod(num_layers, num_model_stages)
            balance = [base + (1 if j < extra else 0) for j in range(num_model_stages)]
        else:
            balance = verify_balance(list(config.balance), num_layers)
            if len(balance) != num_model_stages:
                raise ValueError(
                    f"balance {list(config.balance)} has {len(balance)} entries but the "
                    f"pipeline has {num_model_stages} stages; fix: give one layer count per "
                    f"stage, or set num_stages={len(balance)}"
                )
        starts = [sum(balance[:j]) for j in range(len(balance))]
        ranges = tuple(range(s, s + n) for s, n in zip(starts, balance))
        return Layout(config.num_stages, config.stage_to_rank, ranges, config.replica_counts,
                      config.tensor_parallel, tp_index)

    @property
    def world_size(self) -> int:
        return sum(self.replica_counts) * self.tensor_parallel

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The global ranks of each pipeline rank's replicas (of this tensor-parallel index).

        Example:
            >>> from pipetrain.api.config import PipelineConfig
            >>> config = PipelineConfig(num_stages=2, replicas=2)
            >>> Layout.create(config, num_layers=2).groups
            ((0, 1), (2, 3))
            >>> Layout(2, (0, 1), (range(0, 1), range(1, 2)), (1, 1), 2, 1).groups
            ((1,), (3,))
        """
        t, tp = self.tp_index, self.tensor_parallel
        return tuple(tuple(r * tp + t for r in group)
                     for group in replica_ranks(self.replica_counts))

    @property
    def uniform(self) -> bool:
        """Whether every pipeline rank has the same number of replicas."""
        return len(set(self.replica_counts)) == 1

    def global_rank(self, *, pipeline_rank: int, replica: int) -> int:
        """The global rank of a pipeline rank in a replica."""
        return self.groups[pipeline_rank][replica]

    def position(self, rank: int) -> tuple[int, int]:
        """``(pipeline rank, replica)`` of a global rank."""
        for p, group in enumerate(self.groups):
            if rank in group:
                return p, group.index(rank)
        raise ValueError(f"rank {rank} is not in the job's {self.world_size} ranks")

    def placement(self) -> Placement:
        """Which global rank runs each micro-batch of each model stage."""
        groups = self.groups
        return Placement([groups[p] for p in self.stage_to_rank])

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        """Every global rank holding model stage ``stage`` (its replicas)."""
        return self.groups[self.stage_to_rank[stage]]

    def stages_of(self, pipeline_rank: int) -> tuple[int, ...]:
        """Model stages held by a pipeline rank."""
        return tuple(j for j, r in enumerate(self.stage_to_rank) if r == pipeline_rank)

    def stage_of_layer(self, layer: int) -> int:
        """The model stage holding layer ``layer``."""
        for j, layers in enumerate(self.layer_ranges):
            if layer in layers:
                return j
        raise ValueError(f"layer {layer} is not in the model (it has {self.layer_ranges[-1].stop} layers)")

    def channels(self, pipeline_rank: int) -> tuple[list[Channel], list[Channel]]:
        """``(inbound, outbound)`` channels of a pipeline rank: those of its stages whose
        neighbour lives on another rank.

        Example:
            >>> from pipetrain.api.config import PipelineConfig
            >>> inbound, outbound = Layout.create(PipelineConfig(num_stages=2), num_layers=2).channels(1)
            >>> [str(c) for c in inbound], [str(c) for c in outbound]
            (['activations 0->1'], ['gradients 1->0'])
        """
        placement = self.stage_to_rank
        last = len(placement) - 1
        inbound: list[Channel] = []
        outbound: list[Channel] = []
        for j in self.stages_of(pipeline_rank):
            if j > 0 and placement[j - 1] != pipeline_rank:
                inbound.append(Channel(ACTIVATION, j - 1, j))
                outbound.append(Channel(GRADIENT, j, j - 1))
            if j < last and placement[j + 1] != pipeline_rank:
                outbound.append(Channel(ACTIVATION, j, j + 1))
                inbound.append(Channel(GRADIENT, j + 1, j))
        return inbound, outbound


class StageModule(nn.Sequential):
    """The consecutive layers of one stage, applied in order (an ``nn.Sequential``);
    children are named by their global layer index.

    Example:
        >>> import torch
        >>> stage = StageModule({3: nn.Linear(2, 2), 4: nn.ReLU()})
        >>> [name for name, _ in stage.named_children()]
        ['3', '4']
        >>> stage(torch.zeros(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__(OrderedDict((str(index), layer) for index, layer in layers.items()))
