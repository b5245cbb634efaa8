"""Ordinary (non-sequential) models with skip connections that cross stages, their
single-process reference, and the worker function of the frontend's vision tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig

Params = dict[str, torch.Tensor]


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.ReLU())


class UNet(nn.Module):
    """A small U-Net: every encoder level's features skip to its decoder level."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.enc1 = _conv(1, width)
        self.enc2 = _conv(width, 2 * width)
        self.mid = _conv(2 * width, 2 * width)
        self.dec2 = _conv(4 * width, width)
        self.dec1 = _conv(2 * width, width)
        self.head = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)                                  # (B, w, 16, 16)
        e2 = self.enc2(F.max_pool2d(e1, 2))                # (B, 2w, 8, 8)
        m = self.mid(F.max_pool2d(e2, 2))                  # (B, 2w, 4, 4)
        d2 = self.dec2(torch.cat([F.interpolate(m, scale_factor=2.0), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1))
        return self.head(d1)


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class ResNet(nn.Module):
    """A ResNet-style network: residual blocks in stages, pooling and a linear head."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.layer1 = nn.Sequential(Residual(width), Residual(width))
        self.layer2 = nn.Sequential(Residual(width), Residual(width))
        self.fc = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(F.avg_pool2d(self.layer1(F.relu(self.stem(x))), 2))
        return self.fc(h.mean(dim=(2, 3)))


SPLITS = {"unet": {2: ["mid"], 4: ["enc2", "mid", "dec1"]},
          "resnet": {2: ["layer1.1.conv2"], 4: ["layer1.1.conv2", "layer2.0", "fc"]}}
"""Split points; ResNet's first cuts a residual block, so its skip crosses the cut."""


def vision_model(kind: str) -> nn.Module:
    torch.manual_seed(7)
    return UNet() if kind == "unet" else ResNet()


def vision_batches(kind: str, steps: int, *, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 1, 16, 16, generator=g)
        y = torch.randn(batch, 2, 16, 16, generator=g) if kind == "unet" else torch.randn(batch, 3, generator=g)
        out.append((x, y))
    return out


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def vision_reference(kind: str, steps: int) -> tuple[Params, list[float]]:
    model = vision_model(kind)
    opt = sgd(model.parameters())
    losses = []
    for x, y in vision_batches(kind, steps):
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def vision_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[tuple[Params, list[float]]]:
    from pipetrain.api.pipeline import Pipeline

    results = []
    for entry in configs:
        fields = dict(entry)
        kind, split = fields.pop("kind"), fields.pop("split")
        config = PipelineConfig(**fields)
        batches = vision_batches(kind, steps)
        pipe = Pipeline(vision_model(kind), example_inputs=(batches[0][0],),
                        split_points=SPLITS[kind][config.num_stages] if split else None,
                        loss_fn=F.mse_loss, optimizer=sgd, config=config, context=ctx)
        losses = [pipe.train_step(x, y) for x, y in batches]
        results.append(({k: v.clone() for k, v in pipe.state_dict().items()}, losses))
        pipe.close()
    return results
