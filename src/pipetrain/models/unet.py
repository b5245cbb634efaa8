"""U-Net: an encoder-decoder whose skip connections jump over several layers.

A flat ``nn.Sequential``; each encoder level stashes its input and the matching decoder
level pops it, so the skips cross 4, 8, ... layers and any cut into stages makes some
of them cross stage boundaries. Each level's skip is named ``"skip"`` and isolated in
its own :class:`~pipetrain.skip.Namespace`. For ``depth=2``, ``channels=C``::

    index  name        what                                  shape out (input B, I, H, W)
    0      stem        conv 3x3                              (B, C, H, W)
    1      down0       stash skip@0, conv 3x3 stride 2       (B, 2C, H/2, W/2)
    2      encode0     conv 3x3                              (B, 2C, H/2, W/2)
    3      down1       stash skip@1, conv 3x3 stride 2       (B, 4C, H/4, W/4)
    4      encode1     conv 3x3                              (B, 4C, H/4, W/4)
    5      bottleneck  conv 3x3                              (B, 4C, H/4, W/4)
    6      up1         transposed conv 2x2 stride 2          (B, 2C, H/2, W/2)
    7      merge1      pop skip@1, concat, conv 3x3          (B, 2C, H/2, W/2)
    8      up0         transposed conv 2x2 stride 2          (B, C, H, W)
    9      merge0      pop skip@0, concat, conv 3x3          (B, C, H, W)
    10     head        conv 1x1                              (B, O, H, W)

``3 + 4 * depth`` layers; H and W must be multiples of ``2 ** depth``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator
from typing import cast

import torch
from torch import Tensor, nn

from pipetrain.skip import Namespace, Skippable, pop, skippable, stash

__all__ = ["ConvBlock", "Down", "Merge", "Stem", "unet"]


def _conv(in_channels: int, out_channels: int, *, stride: int, batch_norm: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, 3, stride, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Stem(nn.Module):
    """The first layer: checks the image size, then a 3x3 convolution."""

    def __init__(self, in_channels: int, out_channels: int, *, depth: int, batch_norm: bool):
        super().__init__()
        self.multiple = 2**depth
        self.conv = _conv(in_channels, out_channels, stride=1, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Tensor:  # (B, I, H, W) -> (B, C, H, W)
        height, width = x.shape[-2:]
        if height % self.multiple or width % self.multiple:
            raise ValueError(
                f"U-Net input height and width must be multiples of {self.multiple}, got "
                f"shape {tuple(x.shape)}; fix: resize or pad the images, e.g. to "
                f"{self.multiple * max(1, round(height / self.multiple))} x "
                f"{self.multiple * max(1, round(width / self.multiple))}"
            )
        return self.conv(x)  # type: ignore[no-any-return]


class ConvBlock(nn.Module):
    """A 3x3 convolution keeping the shape (with optional batch norm), then ReLU."""

    def __init__(self, channels: int, *, batch_norm: bool) -> None:
        super().__init__()
        self.conv = _conv(channels, channels, stride=1, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)  # type: ignore[no-any-return]


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stash the input as ``"skip"``; halve the image, double the channels."""

    def __init__(self, channels: int, *, batch_norm: bool) -> None:
        super().__init__()
        self.conv = _conv(channels, 2 * channels, stride=2, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Generator[stash, None, Tensor]:
        yield stash("skip", x)  # (B, c, h, w)
        return self.conv(x)  # type: ignore[no-any-return]  # (B, 2c, h/2, w/2)


@skippable(pop=["skip"])
class Merge(nn.Module):
    """Pop ``"skip"``, concatenate it to the input's channels, mix them back."""

    def __init__(self, channels: int, *, batch_norm: bool) -> None:
        super().__init__()
        self.conv = _conv(2 * channels, channels, stride=1, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Generator[pop, Tensor, Tensor]:
        skip = yield pop("skip")  # (B, c, h, w), like x
        return self.conv(torch.cat([x, skip], dim=1))  # type: ignore[no-any-return]


def unet(
    depth: int = 2,
    *,
    channels: int = 8,
    in_channels: int = 3,
    out_channels: int = 3,
    batch_norm: bool = False,
    seed: int = 0,
) -> nn.Sequential:
    """A small U-Net as an ``nn.Sequential`` of ``3 + 4 * depth`` layers (see the module).

    The weights depend only on the arguments: they are drawn from a CPU generator
    seeded with ``seed`` (the global random state is left as it was).

    Raises:
        ValueError: ``depth`` or a channel count below 1.

    Example:
        >>> import torch
        >>> model = unet(depth=2, channels=4)
        >>> len(model), model(torch.zeros(2, 3, 8, 8)).shape
        (11, torch.Size([2, 3, 8, 8]))
    """
    sizes = {"depth": depth, "channels": channels, "in_channels": in_channels,
             "out_channels": out_channels}
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        raise ValueError(
            f"unet() needs positive sizes, got {bad}; fix: e.g. unet(depth=2, channels=8)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["stem"] = Stem(in_channels, channels, depth=depth, batch_norm=batch_norm)
        namespaces = [Namespace() for _ in range(depth)]
        # cast: mypy does not see that @skippable turns Down and Merge into Skippables.
        for level in range(depth):
            width = channels * 2**level
            down = cast(Skippable, Down(width, batch_norm=batch_norm))
            layers[f"down{level}"] = down.isolate(namespaces[level])
            layers[f"encode{level}"] = ConvBlock(2 * width, batch_norm=batch_norm)
        layers["bottleneck"] = ConvBlock(channels * 2**depth, batch_norm=batch_norm)
        for level in reversed(range(depth)):
            width = channels * 2**level
            layers[f"up{level}"] = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
            merge = cast(Skippable, Merge(width, batch_norm=batch_norm))
            layers[f"merge{level}"] = merge.isolate(namespaces[level])
        layers["head"] = nn.Conv2d(channels, out_channels, 1)
    return nn.Sequential(layers)
