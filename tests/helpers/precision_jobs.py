"""Mixed-precision runs: a Pipeline under bf16 / fp16 autocast and the same training in one
process (same micro-batches, same autocast, torch.amp.GradScaler for fp16).

A layer of the last stage can poison its weight's gradient with ``inf`` at chosen steps on
chosen ranks (:class:`Poisoned`), so a test sees one stage (one replica) overflow.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig
from pipetrain.microbatch import split_batch
from pipetrain.models.mlp import mlp_layer
from pipetrain.runtime.precision import LossScaling

WIDTH = 16
DEPTH = 6
BATCH = 12
STEPS = 5
SCALING = LossScaling(init_scale=2.0**10, growth_interval=2)
"""Small enough to grow within the run: the scale doubles after 2 finite steps."""
POISONED_STEP = 2
"""The step (0-based) at which the poisoned layer's weight gradient becomes inf."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Poisoned(nn.Module):
    """``mlp_layer`` whose linear weight's gradient turns to inf at ``poison_steps``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.inner = mlp_layer(width=WIDTH, activation="gelu", seed=0, index=index)
        self.step = 0
        self.poison_steps: Collection[int] = ()
        weight = self.inner[0].weight
        weight.register_hook(lambda g: torch.full_like(g, float("inf")) if self.step in self.poison_steps else g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


def _layer(index: int) -> nn.Module:
    return Poisoned(index) if index == DEPTH - 1 else mlp_layer(width=WIDTH, activation="gelu", seed=0,
                                                                index=index)


def factories() -> list[Any]:
    return [functools.partial(_layer, index) for index in range(DEPTH)]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(STEPS)]


def _poison(model: nn.Module, step: int, steps: Collection[int]) -> None:
    for module in model.modules():
        if isinstance(module, Poisoned):
            module.step, module.poison_steps = step, steps


def reference(precision: str | None, num_microbatches: int, *, poison: bool,
              device: str = "cpu") -> dict[str, Any]:
    """Single-process training: each micro-batch's loss, weighted by its share, backward
    under the same autocast (none for ``None``); fp16 through torch.amp.GradScaler."""
    torch.set_num_threads(1)
    model = nn.Sequential(*(f() for f in factories())).to(device)
    initial = {f"layers.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = (torch.amp.GradScaler(torch.device(device).type, init_scale=SCALING.init_scale,
                                   growth_interval=SCALING.growth_interval)
              if precision == "fp16" else None)
    losses, scales = [], []
    for step, (x, y) in enumerate(batches()):
        _poison(model, step, (POISONED_STEP,) if poison else ())
        x, y = x.to(device), y.to(device)
        total = 0.0
        for xs, ys in zip(split_batch(x, num_microbatches), split_batch(y, num_microbatches)):
            with torch.autocast(torch.device(device).type, dtype=DTYPES.get(precision, torch.bfloat16),
                                enabled=precision is not None):
                loss = F.mse_loss(model(xs), ys) * (len(xs) / len(x))
            total += loss.item()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
        losses.append(total)
    weights = {f"layers.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "scales": scales, "initial": initial}


def pipeline_job(ctx: Any, configs: list[dict[str, Any]], poison_ranks: Collection[int]) -> list[dict[str, Any]]:
    """Train each configuration; per step the loss, the scale, whether it was skipped, and
    whether this rank's weights changed."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for config in configs:
        poison = config.pop("poison", False)
        scaling = SCALING if config.get("mixed_precision") == "fp16" else None
        pipe = Pipeline(factories(), loss_fn=F.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                        config=PipelineConfig(loss_scaling=scaling, **config), context=ctx)
        losses, scales, skipped, changed = [], [], [], []
        for step, (x, y) in enumerate(batches()):
            _poison(pipe.model, step, (POISONED_STEP,) if poison and ctx.rank in poison_ranks else ())
            before = [p.detach().clone() for p in pipe.parameters()]
            losses.append(pipe.train_step(x, y))
            scaler = pipe.optimizers.scaler
            scales.append(scaler.scale if scaler is not None else None)
            skipped.append(pipe.last_step_skipped)
            changed.append(any(not torch.equal(b, p) for b, p in zip(before, pipe.parameters())))
        weights = {k: v.detach().cpu().clone() for k, v in pipe.named_parameters().items()}
        results.append({"weights": weights, "losses": losses, "scales": scales, "skipped": skipped,
                        "changed": changed})
        pipe.close()
    return results

