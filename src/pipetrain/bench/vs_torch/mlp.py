"""Part 1, the MLP (communication- and overhead-sensitive): every schedule, both frameworks.

``depth`` x [Linear(width, width) + GELU] (each pair one layer, from pipetrain's seeded
layer factories, so both frameworks start from the same weights), batch split into
micro-batches, MSE loss against a fixed target, SGD; 2 ranks x 1 thread. The ideal step
of each schedule uses the per-stage costs of plain autograd running its order in the same
timed loop (:class:`~pipetrain.bench.vs_torch.plain.PlainOrder`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipetrain.bench.harness import foreign_load
from pipetrain.bench.vs_torch.analysis import compare, runner_rows
from pipetrain.bench.vs_torch.options import Options
from pipetrain.bench.vs_torch.plain import (
    PlainOrder,
    beside_pipelines,
    gather_plain_costs,
    order_costs,
)
from pipetrain.bench.vs_torch.runners import PipetrainRunner, TorchRunner
from pipetrain.bench.vs_torch.session import build_runners, first_losses, time_runners

__all__ = ["LR", "analyse_mlp", "mlp_worker"]

LR = 0.01


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR)


def _reference_losses(factories: Sequence[Any], pool: Sequence[Any], target: Any) -> list[float]:
    import torch
    from torch import nn

    model = nn.Sequential(*(f() for f in factories))
    opt = _sgd(model.parameters())
    losses = []
    for k in range(2):
        loss = torch.nn.functional.mse_loss(model(pool[k % len(pool)]), target)
        losses.append(loss.item())
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def mlp_worker(ctx: Any, opts: Options) -> dict[str, Any]:
    """Every rank: build, check, time; rank 0 returns everything gathered."""
    import torch
    import torch.distributed as dist

    from pipetrain.models import mlp_layer_factories

    factories = mlp_layer_factories(width=opts.width, depth=opts.depth, activation="gelu", seed=0)
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(opts.batch, opts.width, generator=gen) for _ in range(4)]
    target = torch.randn(opts.batch, opts.width, generator=gen)  # fixed target

    def batch(k: int) -> tuple[Any, Any]:
        return pool[k % len(pool)], target

    common: dict[str, Any] = {"microbatches": opts.microbatches, "loss_fn": torch.nn.functional.mse_loss,
              "optimizer": _sgd}
    runners, failures = build_runners(
        opts.schedules,
        lambda schedule: PipetrainRunner(ctx, schedule, factories, **common),
        lambda schedule, variant: TorchRunner(ctx, schedule, variant, factories, **common,
                                              trace=opts.trace_torch,
                                              timeout=opts.torch_timeout))
    losses = first_losses(runners, batch, failures)
    reference = _reference_losses(factories, pool, target)
    timed, plains = beside_pipelines(runners, lambda r: PlainOrder(
        r.pipe.schedule(opts.microbatches), factories, rank=dist.get_rank(),
        loss_fn=torch.nn.functional.mse_loss, optimizer=_sgd, example=pool[0]))
    gathered, info = time_runners(timed, batch, reps=opts.reps, warmup=opts.warmup,
                                  microbatches=opts.microbatches)
    plain = gather_plain_costs(plains)
    if dist.get_rank() != 0:
        return {}
    return {"runners": info, "gathered": gathered, "failures": failures,
            "first_losses": losses, "reference_losses": reference, "plain": plain}


def analyse_mlp(raw: dict[str, Any], opts: Options) -> dict[str, Any]:
    """The report's figures from what the ranks gathered (in the parent)."""
    plain = raw["plain"]
    runners = {label: info for label, info in raw["runners"].items()
               if info["framework"] != "plain"}
    rows = runner_rows(runners, raw["gathered"],
                       lambda info: order_costs(plain, info["schedule"], info["stage_to_rank"]),
                       opts.microbatches)
    return {"schedules": compare(rows, opts.schedules, raw["failures"], raw["first_losses"],
                                 raw["reference_losses"]),
            "reference_losses": raw["reference_losses"],
            "load_during_timing": foreign_load([g["cpu_window"] for g in raw["gathered"]]),
            "plain_costs_s": plain}
