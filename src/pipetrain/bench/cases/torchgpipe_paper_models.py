"""The torchgpipe paper's workloads at a CPU size: AmoebaNet-D and U-Net, their batches,
losses and balances, and each runner's wrapping of the same model.

A :class:`Workload` is a model at one size with its batch and loss, as torchgpipe's
benchmarks train it (``benchmarks/amoebanetd-speed``: cross entropy over random labels;
``benchmarks/unet-speed``: binary cross entropy with logits against a target of ones).
:func:`wrap` turns the same ``nn.Sequential`` into what a runner trains:
``pipetrain.GPipe``, ``torchgpipe.GPipe`` (its U-Net's skips rewritten with
``torchgpipe.skip``, see :func:`torchgpipe_skips`) or the plain model.

Example:
    >>> work = Workload(model="unet", size=(2, 4), image=16, batch=4)
    >>> model = work.build()
    >>> inputs, target = work.inputs()
    >>> work.loss(model(inputs), target).dim()
    0
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import OrderedDict
from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipetrain.api.gpipe import GPipe
from pipetrain.bench.gpipe_runs import NAMES
from pipetrain.models.amoebanet import AmoebaNetConfig, build_amoebanet
from pipetrain.models.unet import unet
from pipetrain.partition import solve
from pipetrain.skip import Skippable
from pipetrain.skip import stash as pipetrain_stash

__all__ = ["MODELS", "RUNNERS", "Workload", "profile_balance", "torchgpipe_skips", "wrap"]

MODELS = ("amoebanet", "unet")
RUNNERS = NAMES
"""``pipetrain``, ``torchgpipe``, ``plain``: as in case ``gpipe_vs_torchgpipe``."""
_NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A model at one size, its batch and its loss: what every runner trains.

    ``size`` is ``(L, D)`` of AmoebaNet-D (normal cells, filters) or ``(depth,
    channels)`` of the U-Net; images are ``image`` x ``image`` pixels, ``batch`` of them.
    Both models use batch norm, as the paper's do.

    Example:
        >>> Workload(model="amoebanet", size=(6, 32), image=64, batch=32).label
        'AmoebaNet-D (6, 32), 64x64 images, batch 32'
    """

    model: str
    size: tuple[int, int]
    image: int
    batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is not one of {list(MODELS)}")

    @property
    def label(self) -> str:
        name = "AmoebaNet-D" if self.model == "amoebanet" else "U-Net"
        return f"{name} {self.size}, {self.image}x{self.image} images, batch {self.batch}"

    def build(self) -> nn.Sequential:
        """The model, with weights that depend only on the workload."""
        if self.model == "amoebanet":
            config = AmoebaNetConfig(num_normal_cells=self.size[0], num_filters=self.size[1],
                                     num_classes=_NUM_CLASSES)
            return build_amoebanet(config, seed=self.seed)
        return unet(self.size[0], channels=self.size[1], out_channels=1, batch_norm=True,
                    seed=self.seed)

    def inputs(self) -> tuple[Tensor, Tensor]:
        """The batch (B, 3, image, image) and its target, the same in every process."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        images = torch.rand(self.batch, 3, self.image, self.image, generator=generator)
        if self.model == "amoebanet":
            return images, torch.randint(_NUM_CLASSES, (self.batch,), generator=generator)
        return images, torch.ones(self.batch, 1, self.image, self.image)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        if self.model == "amoebanet":
            return F.cross_entropy(output, target)
        return F.binary_cross_entropy_with_logits(output, target)


def profile_balance(workload: Workload, num_partitions: list[int], *,
                    passes: int = 3) -> dict[int, list[int]]:
    """A balance for each partition count, from each layer's forward time in the plain
    model (median over ``passes`` forward passes on the workload's batch, after one
    untimed pass).

    Example:
        >>> work = Workload(model="unet", size=(2, 4), image=16, batch=2)
        >>> [sum(b) for b in profile_balance(work, [1, 2], passes=1).values()]
        [11, 11]
    """
    model = workload.build()
    images, _ = workload.inputs()
    started: dict[int, float] = {}
    seconds: list[list[float]] = [[] for _ in model]
    hooks = []
    for j, layer in enumerate(model):
        hooks.append(layer.register_forward_pre_hook(
            lambda _m, _x, j=j: started.__setitem__(j, time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda _m, _x, _y, j=j: seconds[j].append(time.perf_counter() - started[j])))
    with torch.no_grad():
        for _ in range(passes + 1):
            model(images)
    for hook in hooks:
        hook.remove()
    costs = [statistics.median(values[1:]) for values in seconds]
    return {k: solve(costs, k) for k in num_partitions}


def wrap(runner: str, model: nn.Sequential, *, balance: list[int], chunks: int,
         checkpoint: str) -> nn.Module:
    """What ``runner`` trains: the model in ``pipetrain.GPipe`` or ``torchgpipe.GPipe``
    (partitions on the CPU, the given balance, chunks and checkpoint mode, every other
    option at its default), or the plain model (``"plain"``).

    Example:
        >>> work = Workload(model="unet", size=(2, 4), image=16, batch=4)
        >>> type(wrap("pipetrain", work.build(), balance=[5, 6], chunks=2,
        ...           checkpoint="never")).__name__
        'GPipe'
    """
    devices = [torch.device("cpu")] * len(balance)
    if runner == "pipetrain":
        return GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    if runner == "torchgpipe":
        import torchgpipe

        return torchgpipe.GPipe(torchgpipe_skips(model), balance, devices=devices,
                                chunks=chunks, checkpoint=checkpoint)
    if runner == "plain":
        return model
    raise ValueError(f"runner={runner!r} is not one of {list(RUNNERS)}")


def torchgpipe_skips(model: nn.Sequential) -> nn.Sequential:
    """The model with every ``pipetrain.skip`` layer rewritten as a ``torchgpipe.skip``
    one (the same module inside, the same skip names and namespaces), so that
    ``torchgpipe.GPipe`` routes its skips; other layers are kept as they are.

    Example:
        >>> import torch
        >>> model = unet(2, channels=4)
        >>> x = torch.randn(1, 3, 8, 8)
        >>> torch.equal(torchgpipe_skips(model)(x), model(x))
        True
    """
    from torchgpipe.skip import Namespace as TorchgpipeNamespace
    from torchgpipe.skip import skippable as torchgpipe_skippable

    namespaces: dict[Any, Any] = {}
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for name, layer in model.named_children():
        if not isinstance(layer, Skippable):
            layers[name] = layer
            continue
        declare = torchgpipe_skippable(stash=sorted(layer.stashable_names),
                                       pop=sorted(layer.poppable_names))
        bridged = declare(_Commands)(layer.module)
        for skip, namespace in layer.namespaces.items():
            if namespace is not None:
                bridged.isolate(namespaces.setdefault(namespace, TorchgpipeNamespace()),
                                only=[skip])
        layers[name] = bridged
    return nn.Sequential(layers)


class _Commands(nn.Module):
    """Runs a ``pipetrain.skip`` module, passing its stash / pop commands on as
    torchgpipe's (inside a ``torchgpipe.skip.skippable`` class)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Generator[Any, Any, Any]:
        from torchgpipe.skip import pop, stash

        commands = self.inner(x)
        reply = None
        try:
            while True:
                command = commands.send(reply)
                if isinstance(command, pipetrain_stash):
                    yield stash(command.name, command.tensor)
                    reply = None
                else:
                    reply = yield pop(command.name)
        except StopIteration as stop:
            return stop.value
