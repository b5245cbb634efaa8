"""Worker functions of the tests of what ranks must agree on: each rank builds its own
configuration, model and batch, differing from the other rank's where a case says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.agreement import DisagreementError, refuse_disagreement
from pipetrain.api.config import PipelineConfig
from pipetrain.models import mlp_layer_factories

WIDTH = 8

Outcome = tuple[str, dict[str, dict[int, str]]] | None
"""A refusal's message and differences, or ``None`` when it was not refused."""


class Tiny(nn.Module):
    """Two linear layers around a ReLU (any nn.Module: captured)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _pipeline(ctx: Any, **config: Any) -> Any:
    from pipetrain.api.pipeline import Pipeline

    return Pipeline(mlp_layer_factories(width=WIDTH, depth=4, seed=0), loss_fn=F.mse_loss,
                    optimizer=_sgd, config=PipelineConfig(**config), context=ctx)


def _refused(build: Callable[[], Any]) -> Outcome:
    try:
        made = build()
    except DisagreementError as error:
        return str(error), error.differences
    if hasattr(made, "close"):
        made.close()
    return None


def disagreement_job(ctx: Any) -> dict[str, Any]:
    """Every case on each of 2 ranks; per case, what was refused (or ``None``)."""
    from pipetrain.api.pipeline import Pipeline

    def mine(first: Any, second: Any) -> Any:  # this rank's value
        return first if ctx.rank == 0 else second

    found: dict[str, Any] = {}
    found["balance"] = _refused(lambda: _pipeline(ctx, balance=mine([1, 3], [2, 2])))
    found["num_microbatches"] = _refused(lambda: _pipeline(ctx, num_microbatches=mine(4, 8)))
    found["schedule"] = _refused(lambda: _pipeline(ctx, schedule=mine("1f1b", "gpipe")))
    found["several"] = _refused(lambda: _pipeline(ctx, balance=mine([1, 3], [2, 2]),
                                                  seed=mine(0, 1), checkpoint="always"))
    found["alias_and_waits"] = _refused(lambda: _pipeline(
        ctx, schedule=mine("1f1b", "pipedream-flush"), timeout=mine(60.0, 120.0),
        heartbeat_timeout=mine(5.0, 10.0), balance=mine((1, 3), [1, 3])))
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    found["captured"] = _refused(lambda: Pipeline(
        Tiny(mine(16, 32)), example_inputs=(x,), loss_fn=F.mse_loss, optimizer=_sgd,
        config=PipelineConfig(num_stages=2, num_microbatches=2, balance=[1, 2]), context=ctx))
    found["cli"] = _refused(lambda: refuse_disagreement(
        {"--balance": mine("1,3", "2,2"), "--microbatches": 8, "--batch-size": mine(8, 16)},
        what="the options of `pipetrain train`", fix="launch every host with the same options"))

    pipe = _pipeline(ctx, num_microbatches=4)
    found["batch"] = _refused(lambda: pipe.train_step(x[:mine(8, 4)], x[:mine(8, 4)]))
    found["step_after_refusal"] = pipe.step
    found["losses"] = [pipe.train_step(x, x), pipe.train_step(x[:5], x[:5])]
    found["steps"] = pipe.step
    pipe.close()
    if ctx.rank == 1:  # gone before the comparison: rank 0 is told, not left waiting
        return found
    try:
        _pipeline(ctx).close()
        found["peer_gone"] = None
    except RuntimeError as error:
        found["peer_gone"] = f"{type(error).__name__}: {error}"
    return found
