"""Worker functions of the tensor-parallel tests: residual MLP blocks split column-wise
(up) and row-wise (down) over the ``tp`` ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig

WIDTH = 16
Params = dict[str, torch.Tensor]


class Block(nn.Module):
    """``x + down(gelu(up(norm(x))))``: ``up`` splits column-wise, ``down`` row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _layer(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    if index == 0:
        return nn.Linear(8, WIDTH)
    if index == 5:
        return nn.Linear(WIDTH, 8)
    return Block()


def layer_factories() -> list[Any]:
    return [lambda i=i: _layer(i) for i in range(6)]


def batches(steps: int, batch: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 3, 8, generator=g), torch.randn(batch, 3, 8, generator=g))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


CLIP = 0.3


def reference(steps: int) -> tuple[Params, list[float], float]:
    """One process: the weights and losses of ``steps`` steps, and the loss of an
    evaluation of the next batch."""
    model = nn.Sequential(*(f() for f in layer_factories()))
    opt = sgd(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return loss.item()

    all_batches = batches(steps + 1)
    losses = [step(x, y) for x, y in all_batches[:steps]]
    params = {f"layers.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        evaluated = float(F.mse_loss(model(all_batches[steps][0]), all_batches[steps][1]))
    return params, losses, evaluated


def make_pipeline(ctx: Any, config: dict[str, Any]) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipetrain.api.pipeline import Pipeline
    from pipetrain.api.tensor_parallel import styles_plan

    plan = styles_plan({"up": ColwiseParallel(), "down": RowwiseParallel()})
    return Pipeline(layer_factories(), loss_fn=F.mse_loss, optimizer=sgd,
                    config=PipelineConfig(clip_grad_norm=CLIP, **config), context=ctx,
                    tensor_parallel_plan=plan if config.get("tensor_parallel", 1) > 1 else None)


def tp_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Train each configuration ``steps`` steps: its whole weights, its losses, which
    weights are DTensors sharded over ``tp``, and the loss of an evaluation of the next
    batch."""
    results = []
    for config in configs:
        pipe = make_pipeline(ctx, config)
        all_batches = batches(steps + 1)
        losses = [pipe.train_step(x, y) for x, y in all_batches[:steps]]
        params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for name, p in pipe.named_parameters().items()}
        split = [name for name, p in pipe.named_parameters().items()
                 if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                 and p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard()]
        evaluated = pipe.eval_step(*all_batches[steps])
        results.append({"params": params, "losses": losses, "split": split, "eval": evaluated})
        pipe.close()
    return results
