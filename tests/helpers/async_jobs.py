"""Workers and single-process references of the asynchronous-schedule tests (float64 MLP).

The references are written from the papers' rules, in plain PyTorch, one process:

- PipeDream (weight stashing): micro-batches in order; micro-batch ``i`` runs stage
  ``j``'s layers with the weights after ``v_j(i)`` updates (``max(0, i - K + j + 1)``,
  or the input stage's ``max(0, i - K + 1)`` with vertical sync), its gradient is taken
  at those weights and applied to the current weights at once (one update per
  micro-batch, every stage).
- 2BW: step ``t``'s gradient is taken at ``W(max(t - 1, 0))`` and applied to ``W(t)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

WIDTH = 6
DEPTH = 4
LR = 0.05

Params = dict[str, torch.Tensor]


def batches(steps: int, batch: int | list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``batch`` samples (or of each size in ``batch``)."""
    g = torch.Generator().manual_seed(3)
    sizes = batch if isinstance(batch, list) else [batch] * steps
    return [(torch.randn(size, WIDTH, generator=g, dtype=torch.float64),
             torch.randn(size, WIDTH, generator=g, dtype=torch.float64)) for size in sizes]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference_model() -> nn.Sequential:
    """The workers' MLP in one process, its weights drawn in float64 as theirs are."""
    from pipetrain.models import build_mlp

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # drawn in float64, as the workers draw them
    try:
        return build_mlp(width=WIDTH, depth=DEPTH, activation="gelu", seed=0)
    finally:
        torch.set_default_dtype(before)


def _factories() -> list[Any]:
    from pipetrain.models import mlp_layer_factories

    return mlp_layer_factories(width=WIDTH, depth=DEPTH, activation="gelu", seed=0)


def stage_of_layers(num_stages: int) -> list[int]:
    """The stage of each layer under the pipeline's even split."""
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.layout import Layout

    ranges = Layout.create(PipelineConfig(num_stages=num_stages), num_layers=DEPTH).layer_ranges
    return [j for j, r in enumerate(ranges) for _ in r]


def _named(model: nn.Module) -> Params:
    return {f"layers.{k}": v.detach().clone() for k, v in model.named_parameters()}


def _checksums(history: list[Params], stages: list[int]) -> dict[int, list[float]]:
    """Per stage, the sum of its weights in each version."""
    return {
        j: [float(sum(t.double().sum() for name, t in params.items()
                      if stages[int(name.split(".")[1])] == j)) for params in history]
        for j in sorted(set(stages))
    }


def pipedream_reference(num_stages: int, *, vertical_sync: bool, steps: int, batch: int,
                        microbatches: int) -> dict[str, Any]:
    """PipeDream's weight stashing in one process (see the module doc)."""
    model = reference_model()
    stages = stage_of_layers(num_stages)
    opt = sgd(model.parameters())
    history = [_named(model)]
    losses, i = [], 0
    for x, y in batches(steps, batch):
        step_loss = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            leaves = {}
            for name in history[0]:
                j = stages[int(name.split(".")[1])]
                version = max(0, i - (num_stages - 1 if vertical_sync else num_stages - 1 - j))
                leaves[name[len("layers."):]] = history[version][name].clone().requires_grad_()
            loss = F.mse_loss(torch.func.functional_call(model, leaves, (xm,)), ym)
            grads = torch.autograd.grad(loss, list(leaves.values()))
            for name, grad in zip(leaves, grads):
                model.get_parameter(name).grad = grad
            opt.step()
            opt.zero_grad()
            history.append(_named(model))
            step_loss += loss.item() * len(xm) / len(x)
            i += 1
        losses.append(step_loss)
    return {"params": _named(model), "losses": losses, "checksums": _checksums(history, stages)}


def two_bw_reference(num_stages: int, *, steps: int, batch: int | list[int],
                     microbatches: int) -> dict[str, Any]:
    """The 2BW rule in one process: W(t+1) = W(t) - lr * grad(W(max(t - 1, 0)))."""
    model = reference_model()
    opt = sgd(model.parameters())
    previous = _named(model)
    history = [previous]
    losses = []
    for x, y in batches(steps, batch):
        leaves = {name[len("layers."):]: t.clone().requires_grad_() for name, t in previous.items()}
        loss = sum(F.mse_loss(torch.func.functional_call(model, leaves, (xm,)), ym) * len(xm) / len(x)
                   for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)))
        assert isinstance(loss, torch.Tensor)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        previous = _named(model)
        for name, grad in zip(leaves, grads):
            model.get_parameter(name).grad = grad
        opt.step()
        opt.zero_grad()
        history.append(_named(model))
        losses.append(loss.item())
    return {"params": _named(model), "losses": losses,
            "checksums": _checksums(history, stage_of_layers(num_stages))}


def async_job(ctx: Any, configs: list[dict[str, Any]], steps: int, batch: int) -> list[dict[str, Any]]:
    """Train each configuration (recording the versions), drain, report."""
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline

    torch.set_default_dtype(torch.float64)
    results = []
    for config in configs:
        pipe = Pipeline(_factories(), loss_fn=F.mse_loss, optimizer=sgd,
                        config=PipelineConfig(nonfinite="ignore", **config), context=ctx)
        assert pipe.async_state is not None
        versions = pipe.async_state.versions
        for stage_versions in versions.values():
            stage_versions.record = []
        losses = [pipe.train_step(x, y) for x, y in batches(steps, batch)]
        pipe.drain()
        results.append({
            "params": {k: v.detach().clone() for k, v in pipe.named_parameters().items()},
            "losses": losses,
            "records": [r for v in versions.values() for r in (v.record or [])],
            "peaks": {j: v.peak_versions for j, v in versions.items()},
            "stashed_bytes": {j: v.peak_stashed_bytes for j, v in versions.items()},
            "param_bytes": {j: sum(p.numel() * p.element_size() for p in v.params)
                            for j, v in versions.items()},
            "rank": pipe.rank,
        })
        pipe.close()
    return results


def _snapshot(pipe: Any) -> Params:
    return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}


def _pipeline(ctx: Any, config: dict[str, Any], **options: Any) -> Any:
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline

    return Pipeline(_factories(), loss_fn=options.pop("loss_fn", F.mse_loss), optimizer=sgd,
                    config=PipelineConfig(nonfinite="ignore", **config), context=ctx, **options)


def resume_job(ctx: Any, configs: list[dict[str, Any]], folder: str) -> list[dict[str, Any]]:
    """Per configuration: 3 steps, save, 3 steps each followed by an evaluation; the same
    without the evaluations; and a new pipeline that loads the save and trains 3 steps."""
    import os

    torch.set_default_dtype(torch.float64)
    data = batches(6, 8)
    results = []
    for c, config in enumerate(configs):
        path = os.path.join(folder, f"checkpoint-{c}")
        runs = []
        for evaluate in (True, False):
            pipe = _pipeline(ctx, config)
            losses = [pipe.train_step(x, y) for x, y in data[:3]]
            pipe.save(path + ("" if evaluate else "-plain"))  # drains
            for x, y in data[3:]:
                losses.append(pipe.train_step(x, y))
                if evaluate:  # micro-batches in flight
                    pipe.eval_step(*data[0])
            pipe.drain()
            runs.append((_snapshot(pipe), losses))
            pipe.close()
        pipe = _pipeline(ctx, config)
        pipe.load(path)
        losses = [pipe.train_step(x, y) for x, y in data[3:]]
        pipe.drain()
        results.append({"evaluated": runs[0], "plain": runs[1], "resumed": (_snapshot(pipe), losses),
                        "step": pipe.step})
        pipe.close()
    return results


def odd_input_job(ctx: Any, sizes: list[int]) -> dict[str, Any]:
    """2BW on batches of ``sizes`` samples (a smaller one has fewer micro-batches: the
    pipeline drains), and the message refusing tied weights."""
    torch.set_default_dtype(torch.float64)
    pipe = _pipeline(ctx, {"schedule": "2bw", "num_stages": 2, "num_microbatches": 4})
    losses = [pipe.train_step(x, y) for x, y in batches(len(sizes), sizes)]
    pipe.drain()
    result: dict[str, Any] = {"params": _snapshot(pipe), "losses": losses}
    pipe.close()
    try:
        _pipeline(ctx, {"schedule": "pipedream", "num_stages": 2, "num_microbatches": 2},
                  ties=[((0, "0.weight"), (3, "0.weight"))])
    except ValueError as error:
        result["ties"] = str(error)
    return result
