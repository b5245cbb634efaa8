"""The stages of one rank of a :class:`~pipetrain.api.pipeline.Pipeline`: their layers,
the skip connections that cross them, their random streams and deferred batch norms.

Skip connections (``@skippable`` layers, :mod:`pipetrain.skip`) cross processes in the
activation message (``(output, [skip tensors])``) and their gradients come back with the
activation's. Which skips cross which boundary is read from every layer's declarations;
a rank builds only its own layers, so when any rank holds a skippable layer every rank
builds the layers it does not hold on the ``meta`` device (no memory, no weights) to
read theirs. The routes are ordered by layer, so the ranks agree on the message layout
although each process has its own :class:`~pipetrain.skip.Namespace` objects.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import LayerSource, Layout, StageModule
from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.runtime.offload import ActivationOffload
from pipetrain.runtime.rng import RandomStreams
from pipetrain.runtime.stage import LossFn, StageCompute
from pipetrain.skip import SkipLayout, Skippable, skip_layout

__all__ = ["build_stages", "convert_batch_norms", "model_skip_layout", "stage_parameters"]


def convert_batch_norms(layers: dict[int, nn.Module], config: PipelineConfig) -> None:
    """With ``config.deferred_batch_norm``, turn every tracking batch norm of ``layers``
    into a :class:`~pipetrain.batchnorm.DeferredBatchNorm` counting the micro-batches of
    the whole mini-batch (every replica's), in place.

    Example:
        >>> layers = {0: nn.BatchNorm1d(3)}
        >>> convert_batch_norms(layers, PipelineConfig(num_microbatches=4, replicas=2,
        ...                                            deferred_batch_norm=True))
        >>> type(layers[0]).__name__, layers[0].chunks
        ('DeferredBatchNorm', 8)
    """
    if not config.deferred_batch_norm:
        return
    chunks = config.total_microbatches
    for i, layer in layers.items():
        layers[i] = DeferredBatchNorm.convert_deferred_batch_norm(layer, chunks)


def _holds_skippable(layers: Collection[nn.Module]) -> bool:
    return any(isinstance(m, Skippable) for layer in layers for m in layer.modules())


def model_skip_layout(source: LayerSource, layers: Mapping[int, nn.Module], *, layout: Layout,
                      device: torch.device) -> SkipLayout:
    """The skip routes of the model stages (a collective: every rank calls it).

    ``layers`` are this rank's layers by global index; the others are built from
    ``source`` on the meta device when some rank holds a skippable layer. ``device``
    is where the job's backend takes tensors (the GPU with NCCL).

    Raises:
        TypeError: the stashes and pops do not match (as :func:`pipetrain.skip.verify_skippables`).
    """
    num_stages = len(layout.layer_ranges)
    flag = torch.tensor([int(_holds_skippable(layers.values()))], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return SkipLayout(num_stages, routes=())
    num_layers = layout.layer_ranges[-1].stop
    everything: list[nn.Module] = []
    # factories may seed torch's generator: leave the caller's as it was
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        for i in range(num_layers):
            if i in layers:
                everything.append(layers[i])
            else:
                built = source[i] if isinstance(source, nn.Sequential) else source[i]()
                everything.append(built)
    stages = [nn.Sequential(*(everything[i] for i in r)) for r in layout.layer_ranges]
    return skip_layout(stages)


def build_stages(
    layers: Mapping[int, nn.Module],
    *,
    layout: Layout,
    local_stages: Collection[int],
    skips: SkipLayout,
    streams: RandomStreams,
    device: torch.device,
    loss_fn: LossFn,
    fuse_weight_gradients: bool,
    autocast: torch.dtype | None = None,
    compile: bool = False,
    modes: Sequence[str] | None = None,
    offload: Sequence[int | None] | None = None,
) -> dict[int, StageCompute]:
    """The compute of this rank's model stages, each running its layers seeded one by one
    (each compiled in place with ``torch.compile`` when ``compile``; a stage whose mode in
    ``modes`` is ``selective`` keeps only its matrix products' outputs for backward, see
    :mod:`pipetrain.runtime.selective`, and one in ``per_layer`` re-materializes each layer
    on its own; one with a budget in ``offload`` moves what its
    forwards save beyond that many bytes to host memory, :mod:`pipetrain.runtime.offload`).

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> layout = Layout.create(PipelineConfig(num_stages=2), num_layers=4)
        >>> layers = {i: nn.Linear(2, 2) for i in (2, 3)}
        >>> stages = build_stages(layers, layout=layout, local_stages=(1,),
        ...                       skips=SkipLayout(2, routes=()), streams=RandomStreams(),
        ...                       device=torch.device("cpu"), loss_fn=nn.functional.mse_loss,
        ...                       fuse_weight_gradients=True)
        >>> stages[1].first_layer, stages[1].loss_fn is not None
        (2, True)
    """
    last = len(layout.layer_ranges) - 1
    stages: dict[int, StageCompute] = {}
    for j in local_stages:
        if compile:
            for i in layout.layer_ranges[j]:
                layers[i].compile()  # nn.Module.compile: in place, the same parameter names
        module = StageModule({i: layers[i] for i in layout.layer_ranges[j]})
        stages[j] = StageCompute(
            module,
            stage_index=j,
            device=device,
            skips_in=skips.incoming(j),
            skips_out=skips.crossing(j),
            loss_fn=loss_fn if j == last else None,
            rng=streams,
            first_layer=layout.layer_ranges[j].start,
            fuse_weight_gradients=fuse_weight_gradients,
            autocast=autocast,
            selective=modes is not None and modes[j] == "selective",
            per_layer=modes is not None and modes[j] == "per_layer",
        )
        budget = offload[j] if offload is not None else None
        if budget is not None:
            stages[j].offload = ActivationOffload(budget, device=device, params=stages[j].params)
    return stages


def stage_parameters(layers: Mapping[int, nn.Module], *, layout: Layout,
                     local_stages: Collection[int]) -> dict[int, list[nn.Parameter]]:
    """The trainable parameters of each of this rank's stages (a parameter shared by
    several layers counts once, in the first stage that holds it).

    Example:
        >>> layout = Layout.create(PipelineConfig(num_stages=1), num_layers=2)
        >>> shared = nn.Linear(2, 2)
        >>> {j: len(p) for j, p in stage_parameters({0: shared, 1: shared}, layout=layout,
        ...                                           local_stages=(0,)).items()}
        {0: 2}
    """
    seen: set[int] = set()
    params: dict[int, list[nn.Parameter]] = {}
    for j in sorted(local_stages):
        own = []
        for i in layout.layer_ranges[j]:
            for p in layers[i].parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    own.append(p)
        params[j] = own
    return params
