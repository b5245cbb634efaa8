"""AmoebaNet-D: an image classifier of evolved normal and reduction cells, as a flat layer sequence.

AmoebaNet-D (L, D) is the model GPipe and torchgpipe benchmark: ``L`` normal cells in
three stacks, ``D`` filters. Each cell reads the two previous cells' outputs, so every
cell takes and returns a pair ``(output, previous output)`` and a pipeline may cut
between any two layers (the pair crosses the cut). For
``AmoebaNetConfig(num_normal_cells=L, num_filters=D)`` and images (B, I, H, W)::

    index      layer            what                                  output[0]
    0          Stem             conv 3x3 stride 2, norm               (B, D/4, H/2, W/2)
    1, 2       Cell (reduce)    stem reduction cells                  (B, 3D, H/8, W/8) after both
    3..        Cell (normal)    L/3 normal cells                      (B, 4D, H/8, W/8)
    .          Cell (reduce)    reduction cell                        (B, 6D, H/16, W/16)
    ..         Cell (normal)    L/3 normal cells                      (B, 8D, H/16, W/16)
    .          Cell (reduce)    reduction cell                        (B, 12D, H/32, W/32)
    ..         Cell (normal)    L/3 normal cells                      (B, 16D, H/32, W/32)
    L + 5      Classifier       global average pool, linear           logits (B, num_classes)

``L + 6`` layers; H and W must be multiples of 32. A normal cell's operations have as
many channels as its stack's filters (D, 2D, 4D) and it outputs four of their results
concatenated; a reduction cell halves the image, doubles the filters and outputs three.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor, nn

from pipetrain.models.factory import LayerFactory, build_sequential, seeded

__all__ = [
    "AmoebaNetConfig",
    "Cell",
    "Classifier",
    "Stem",
    "amoebanet_layer_factories",
    "build_amoebanet",
]

_NORMS = ("batch", "group")

# AmoebaNet-D's cells (Real et al., 2019, in the form GPipe trained): five steps, each the
# sum of two operations on earlier states, as ((state, op), (state, op)). State 0 is the
# previous cell's output, state 1 the one before (both projected to the cell's channels),
# states 2.. the steps' sums; the cell outputs the listed states, concatenated.
_NORMAL_STEPS = (
    ((1, "conv1x1"), (1, "max3x3")),
    ((1, "identity"), (0, "conv1x7_7x1")),
    ((0, "conv1x1"), (0, "conv1x7_7x1")),
    ((2, "max3x3"), (2, "identity")),
    ((1, "avg3x3"), (5, "conv1x1")),
)
_NORMAL_OUTPUT = (0, 3, 4, 6)
_REDUCTION_STEPS = (  # operations on states 0 and 1 have stride 2
    ((0, "max2x2"), (0, "max3x3")),
    ((2, "identity"), (1, "conv3x3")),
    ((2, "conv1x7_7x1"), (2, "max3x3")),
    ((3, "identity"), (1, "max2x2")),
    ((2, "avg3x3"), (3, "conv1x1")),
)
_REDUCTION_OUTPUT = (4, 5, 6)
_IMAGE_MULTIPLE = 32  # stem, two stem reductions, two reductions between the stacks


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmoebaNetConfig:
    """The shape of an AmoebaNet-D (L, D): ``num_normal_cells=L``, ``num_filters=D``.

    ``norm="group"`` (GroupNorm) makes every sample independent of the others in its
    batch, so micro-batching does not change the result; ``"batch"`` (BatchNorm, the
    original) needs deferred batch norm in a pipeline to match unpipelined training.

    Example:
        >>> AmoebaNetConfig(num_normal_cells=6, num_filters=32).num_layers
        12
    """

    num_normal_cells: int = 6
    num_filters: int = 64
    in_channels: int = 3
    num_classes: int = 10
    norm: str = "batch"

    def __post_init__(self) -> None:
        problems = []
        for name, example in (("num_normal_cells", 6), ("num_filters", 64),
                              ("in_channels", 3), ("num_classes", 10)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive int, e.g. {name}={example}")
        if isinstance(self.num_normal_cells, int) and self.num_normal_cells % 3:
            problems.append(f"num_normal_cells={self.num_normal_cells} must be a multiple of 3 "
                            f"(three stacks), e.g. {3 * max(1, round(self.num_normal_cells / 3))}")
        if isinstance(self.num_filters, int) and self.num_filters % 8:
            problems.append(f"num_filters={self.num_filters} must be a multiple of 8, e.g. "
                            f"{8 * max(1, round(self.num_filters / 8))}")
        if self.norm not in _NORMS:
            problems.append(f"norm={self.norm!r} is not one of {list(_NORMS)}")
        if problems:
            raise ValueError("invalid AmoebaNetConfig: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        """Number of layers: stem, 4 reduction cells, the normal cells, classifier."""
        return self.num_normal_cells + 6


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(channels, 8), channels)


def _relu_conv_norm(in_channels: int, out_channels: int, kernel: tuple[int, int], *,
                    stride: int, norm: str) -> nn.Sequential:
    padding = (kernel[0] // 2, kernel[1] // 2)
    return nn.Sequential(nn.ReLU(), nn.Conv2d(in_channels, out_channels, kernel, stride,
                                              padding, bias=False), _norm(norm, out_channels))


def _operation(name: str, channels: int, *, stride: int, norm: str) -> nn.Module:
    """One operation of a cell; (B, C, H, W) -> (B, C, H/stride, W/stride)."""
    if name == "identity":
        assert stride == 1, "the genotype applies identity to same-size states only"
        return nn.Identity()
    if name == "conv1x1":
        return _relu_conv_norm(channels, channels, (1, 1), stride=stride, norm=norm)
    if name == "conv3x3":
        return _relu_conv_norm(channels, channels, (3, 3), stride=stride, norm=norm)
    if name == "conv1x7_7x1":
        return nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, channels, (1, 7), (1, stride), (0, 3), bias=False),
            nn.Conv2d(channels, channels, (7, 1), (stride, 1), (3, 0), bias=False),
            _norm(norm, channels),
        )
    if name == "max3x3":
        return nn.MaxPool2d(3, stride, padding=1)
    if name == "avg3x3":
        return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)
    assert name == "max2x2" and stride == 2, f"unknown operation {name!r}"
    return nn.MaxPool2d(2, 2)


class Stem(nn.Module):
    """Layer 0: 3x3 convolution with stride 2, then norm; (B, I, H, W) -> (B, D/4, H/2, W/2)."""

    def __init__(self, in_channels: int, channels: int, *, norm: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, 2, padding=1, bias=False)
        self.norm = _norm(norm, channels)

    def forward(self, x: Tensor) -> Tensor:
        height, width = x.shape[-2:]
        if height % _IMAGE_MULTIPLE or width % _IMAGE_MULTIPLE:
            m = _IMAGE_MULTIPLE
            raise ValueError(
                f"AmoebaNet input height and width must be multiples of {m}, got shape "
                f"{tuple(x.shape)}; fix: resize or pad the images, e.g. to "
                f"{m * max(1, round(height / m))} x {m * max(1, round(width / m))}"
            )
        return self.norm(self.conv(x))  # type: ignore[no-any-return]


class Cell(nn.Module):
    """A normal or reduction cell: (output, previous output) -> (its output, output).

    The first cell after the stem takes the stem's tensor as both inputs.
    """

    def __init__(self, channels: int, *, reduction: bool, in_channels: int,
                 in_channels_before: int, before_is_larger: bool, norm: str) -> None:
        super().__init__()
        self.project = _relu_conv_norm(in_channels, channels, (1, 1), stride=1, norm=norm)
        self.project_before: nn.Module = nn.Identity()
        if before_is_larger:  # the previous cell halved the image: pool, then project
            self.project_before = nn.Sequential(
                nn.AvgPool2d(2), _relu_conv_norm(in_channels_before, channels, (1, 1),
                                                 stride=1, norm=norm))
        elif in_channels_before != channels:
            self.project_before = _relu_conv_norm(in_channels_before, channels, (1, 1),
                                                  stride=1, norm=norm)
        steps = _REDUCTION_STEPS if reduction else _NORMAL_STEPS
        self.inputs = [state for step in steps for state, _ in step]
        self.output_states = _REDUCTION_OUTPUT if reduction else _NORMAL_OUTPUT
        self.operations = nn.ModuleList(
            _operation(name, channels, stride=2 if reduction and state < 2 else 1, norm=norm)
            for step in steps for state, name in step
        )

    def forward(self, states: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, before = states if isinstance(states, tuple) else (states, states)
        computed = [self.project(x), self.project_before(before)]  # (B, C, h, w) each
        for k in range(0, len(self.operations), 2):
            first, second = self.operations[k], self.operations[k + 1]
            computed.append(first(computed[self.inputs[k]])
                            + second(computed[self.inputs[k + 1]]))
        output = torch.cat([computed[i] for i in self.output_states], dim=1)
        return output, x  # (B, 4C or 3C, h or h/2, w or w/2), the input for the next cell


class Classifier(nn.Module):
    """The last layer: global average pool and linear; (output, _) -> logits (B, num_classes)."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(channels, num_classes)

    def forward(self, states: tuple[Tensor, Tensor]) -> Tensor:
        pooled = states[0].mean(dim=(2, 3))  # (B, C)
        return self.linear(pooled)  # type: ignore[no-any-return]


def _new_layer(config: AmoebaNetConfig, index: int) -> nn.Module:
    per_stack = config.num_normal_cells // 3
    kinds = ["reduce"] * 2 + (["normal"] * per_stack + ["reduce"]) * 2 + ["normal"] * per_stack
    channels = config.num_filters // 4
    if index == 0:
        return Stem(config.in_channels, channels, norm=config.norm)
    before = current = channels  # channels of the two previous layers' outputs
    before_is_larger = False
    for position, kind in enumerate(kinds, start=1):
        reduction = kind == "reduce"
        channels *= 2 if reduction else 1
        if position == index:
            return Cell(channels, reduction=reduction, in_channels=current,
                        in_channels_before=before, before_is_larger=before_is_larger,
                        norm=config.norm)
        before, current = current, channels * len(
            _REDUCTION_OUTPUT if reduction else _NORMAL_OUTPUT)
        before_is_larger = reduction
    return Classifier(current, config.num_classes)


def amoebanet_layer_factories(config: AmoebaNetConfig, *, seed: int) -> list[LayerFactory]:
    """One picklable factory per layer: ``[Stem, Cell..., Classifier]``; the initial
    weights of layer ``i`` depend only on ``(seed, i)``.

    Example:
        >>> len(amoebanet_layer_factories(AmoebaNetConfig(num_normal_cells=3), seed=0))
        9
    """
    return [functools.partial(seeded, functools.partial(_new_layer, config, index),
                              seed=seed, index=index) for index in range(config.num_layers)]


def build_amoebanet(config: AmoebaNetConfig, *, seed: int) -> nn.Sequential:
    """The whole AmoebaNet-D in one process: images (B, I, H, W) -> logits (B, num_classes).

    Example:
        >>> import torch
        >>> model = build_amoebanet(AmoebaNetConfig(num_normal_cells=3, num_filters=16), seed=0)
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return build_sequential(amoebanet_layer_factories(config, seed=seed))
