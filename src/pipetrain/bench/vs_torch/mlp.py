"""Part 1, the MLP (communication- and overhead-sensitive): every schedule, both frameworks.

``depth`` x [Linear(width, width) + GELU] (each pair one layer, from pipetrain's seeded
layer factories, so both frameworks start from the same weights), batch split into
micro-batches, MSE loss against a fixed target, SGD; 2 ranks x 1 thread. The ideal step
uses per-stage costs measured with both ranks computing at once, no communication, before
and after the timed steps (each cost the faster of its two measurements)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipetrain.bench.harness import foreign_load, gather_objects
from pipetrain.bench.vs_torch.analysis import compare, runner_rows
from pipetrain.bench.vs_torch.costs import measure_costs, merge_costs
from pipetrain.bench.vs_torch.options import Options
from pipetrain.bench.vs_torch.runners import PipetrainRunner, TorchRunner, placement, stage_ranges
from pipetrain.bench.vs_torch.session import build_runners, first_losses, time_runners

__all__ = ["LR", "analyse_mlp", "faster", "mlp_worker"]

LR = 0.01


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR)


def _isolated(factories: Sequence[Any], num_stages: int, opts: Options) -> dict[str, Any]:
    """Per-stage costs of this rank's stages, both ranks at once (no pipeline)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = dist.get_rank()
    ranges = stage_ranges(len(factories), num_stages)
    mb = opts.batch // opts.microbatches
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(mb, opts.width, generator=gen)
    t = torch.randn(mb, opts.width, generator=gen)
    out: dict[str, Any] = {"forward": {}, "backward": {}, "step": {}}
    stage_to_rank = placement("loop", num_stages)
    for j in range(num_stages):
        if stage_to_rank[j] != rank:
            continue
        last = j == num_stages - 1
        def batch(j: int = j) -> tuple[Any, Any]:
            return x.clone().requires_grad_(j > 0), t

        costs = measure_costs(
            nn.Sequential(*(factories[i]() for i in ranges[j])), batch,
            loss_fn=torch.nn.functional.mse_loss if last else None, optimizer=_sgd,
            microbatches=opts.microbatches,
            rounds=max(1, opts.isolated_repeats // opts.microbatches))
        for name, value in costs.items():
            out[name][j] = value
    return out


def faster(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]
           ) -> dict[str, dict[int, float]]:
    """Each cost of two measurements of the same costs, the smaller.

    Example:
        >>> faster({"forward": {0: 2.0}}, {"forward": {0: 1.5}})
        {'forward': {0: 1.5}}
    """
    return {name: {j: min(value, b[name][j]) for j, value in by_stage.items()}
            for name, by_stage in a.items()}


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
    counts = sorted({r.num_stages for r in runners})

    def isolated_costs() -> dict[int, list[dict[str, Any]]]:
        found = {}
        for num_stages in counts:
            dist.barrier()
            found[num_stages] = gather_objects(_isolated(factories, num_stages, opts))
        return found

    before = isolated_costs()
    gathered, info = time_runners(runners, batch, reps=opts.reps, warmup=opts.warmup,
                                  microbatches=opts.microbatches)
    # measured again after the timing: the ideal takes each cost's faster measurement, so
    # that a moment of disturbance in one of them does not raise the yardstick
    isolated = {n: [faster(a, b) for a, b in zip(before[n], after)]
                for n, after in isolated_costs().items()}
    if dist.get_rank() != 0:
        return {}
    return {"runners": info, "gathered": gathered, "failures": failures,
            "first_losses": losses, "reference_losses": reference, "isolated": isolated}


def analyse_mlp(raw: dict[str, Any], opts: Options) -> dict[str, Any]:
    """The report's figures from what the ranks gathered (in the parent)."""
    isolated = {n: merge_costs(per_rank, n) for n, per_rank in raw["isolated"].items()}
    rows = runner_rows(raw["runners"], raw["gathered"], isolated, opts.microbatches)
    return {"schedules": compare(rows, opts.schedules, raw["failures"], raw["first_losses"],
                                 raw["reference_losses"]),
            "reference_losses": raw["reference_losses"],
            "load_during_timing": foreign_load([g["cpu_window"] for g in raw["gathered"]]),
            "isolated_costs_s": {str(n): c for n, c in isolated.items()}}
