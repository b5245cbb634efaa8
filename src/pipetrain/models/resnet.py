"""ResNet: a small residual image classifier, written as a flat sequence of layers.

Layers of uneven cost (the stem and early blocks work on large images, later blocks on
small ones with more channels), which makes it the example for balancing::

    index 0                 Stem            (B, 3, 32, 32)    -> (B, W0, 32, 32)
    index 1 .. S*N          ResidualBlock   (B, Cin, H, W)    -> (B, Cout, H/s, W/s)
    index S*N + 1           Pool            (B, C, H, W)      -> (B, C)
    index S*N + 2           Classifier      (B, C)            -> logits (B, num_classes)

``S`` stages of ``N`` blocks each; every stage after the first halves the image and
moves to the next width. Each block owns its shortcut, so a pipeline may cut anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from torch import Tensor, nn

from pipetrain.models.factory import LayerFactory, build_sequential, seeded

__all__ = [
    "Classifier",
    "Pool",
    "ResNetConfig",
    "ResidualBlock",
    "Stem",
    "build_resnet",
    "resnet_layer",
    "resnet_layer_factories",
]

_NORMS = ("batch", "group")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """The shape of a ResNet.

    ``norm="group"`` (GroupNorm) makes every sample independent of the others in its
    batch, so micro-batching does not change the result; ``"batch"`` is the classic
    BatchNorm (pipelines need deferred batch norm to match it exactly).

    Example:
        >>> ResNetConfig(widths=(8, 16), num_blocks=1).widths
        (8, 16)
    """

    in_channels: int = 3
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 64)
    num_blocks: int = 2
    norm: str = "batch"

    def __post_init__(self) -> None:
        problems = []
        for name, example in (("in_channels", 3), ("num_classes", 10), ("num_blocks", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive int, e.g. {name}={example}")
        widths = self.widths
        if (
            not isinstance(widths, tuple)
            or not widths
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths)
        ):
            problems.append(
                f"widths={widths!r} must be a non-empty tuple of positive ints, e.g. widths=(16, 32, 64)"
            )
        if self.norm not in _NORMS:
            problems.append(f"norm={self.norm!r} is not one of {list(_NORMS)}")
        if problems:
            raise ValueError("invalid ResNetConfig: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        """Number of layers: stem, blocks, pool, classifier."""
        return len(self.widths) * self.num_blocks + 3


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(channels, 8), channels)


class Stem(nn.Module):
    """Layer 0: 3x3 convolution, normalization, ReLU; (B, Cin, H, W) -> (B, W0, H, W)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.conv = nn.Conv2d(config.in_channels, config.widths[0], 3, padding=1, bias=False)
        self.norm = _norm(config.norm, config.widths[0])
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.norm(self.conv(x)))  # (B, W0, H, W)
        return x


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions plus a shortcut; (B, Cin, H, W) -> (B, Cout, H/stride, W/stride)."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int, norm: str) -> None:
        super().__init__()
        self.conv_1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm_1 = _norm(norm, out_channels)
        self.conv_2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm_2 = _norm(norm, out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                _norm(norm, out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.relu(self.norm_1(self.conv_1(x)))  # (B, Cout, H/s, W/s)
        y = self.norm_2(self.conv_2(y))  # (B, Cout, H/s, W/s)
        y = self.relu(y + self.shortcut(x))  # (B, Cout, H/s, W/s)
        return y


class Pool(nn.Module):
    """Global average pooling: (B, C, H, W) -> (B, C)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=(2, 3))  # (B, C)


class Classifier(nn.Module):
    """The last layer: (B, C) -> logits (B, num_classes)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.widths[-1], config.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.linear(x)  # (B, num_classes)
        return logits


# --- layer factories -----------------------------------------------------------------


def resnet_layer(config: ResNetConfig, *, seed: int, index: int) -> nn.Module:
    """Build layer ``index`` of the ResNet, with initial weights that depend only on ``(seed, index)``.

    Example:
        >>> type(resnet_layer(ResNetConfig(), seed=0, index=1)).__name__
        'ResidualBlock'
    """
    if not 0 <= index < config.num_layers:
        raise ValueError(
            f"index={index} is out of range: this ResNet has layers 0..{config.num_layers - 1}"
        )
    return seeded(functools.partial(_new_layer, config, index), seed=seed, index=index)


def _new_layer(config: ResNetConfig, index: int) -> nn.Module:
    num_blocks = len(config.widths) * config.num_blocks
    if index == 0:
        return Stem(config)
    if index == num_blocks + 1:
        return Pool()
    if index == num_blocks + 2:
        return Classifier(config)
    stage, position = divmod(index - 1, config.num_blocks)
    in_channels = config.widths[max(stage - 1, 0)] if position == 0 else config.widths[stage]
    stride = 2 if stage > 0 and position == 0 else 1
    return ResidualBlock(in_channels, config.widths[stage], stride=stride, norm=config.norm)


def resnet_layer_factories(config: ResNetConfig, *, seed: int) -> list[LayerFactory]:
    """One picklable factory per layer: ``[Stem, ResidualBlock..., Pool, Classifier]``.

    Example:
        >>> len(resnet_layer_factories(ResNetConfig(), seed=0))  # 1 + 3 * 2 + 1 + 1
        9
    """
    return [
        functools.partial(resnet_layer, config, seed=seed, index=index)
        for index in range(config.num_layers)
    ]


def build_resnet(config: ResNetConfig, *, seed: int) -> nn.Sequential:
    """The whole ResNet in one process: images (B, Cin, H, W) -> logits (B, num_classes).

    Example:
        >>> import torch
        >>> build_resnet(ResNetConfig(), seed=0)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return build_sequential(resnet_layer_factories(config, seed=seed))
