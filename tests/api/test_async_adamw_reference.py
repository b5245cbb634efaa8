"""Each schedule's update rule with AdamW and an LR schedule, against single-process references.

The asynchronous tests of ``test_async_versions.py`` train with SGD; the benchmark and
``pipetrain train`` train with AdamW and a warm-up + cosine ``LambdaLR``. Here 1F1B,
PipeDream and 2BW train a float64 MLP on 2 ranks (gloo) with ``AdamW`` and ``LambdaLR``
(``pipetrain train``'s schedule, :func:`pipetrain.api.lr_schedule.lr_factor`), and a
reference written here in plain PyTorch, one process, applies the same rule (the rules
of ``helpers.async_jobs``):

- 1F1B: step ``t``'s gradient, taken at ``W(t)``, updates ``W(t)`` with step ``t``'s LR;
- PipeDream (weight stashing): micro-batch ``i`` runs stage ``j`` with the weights after
  ``max(0, i - K + j + 1)`` updates, its gradient updates the current weights at once
  (one AdamW step per micro-batch), and the LR schedule steps once per training step
  (after its ``M`` updates: every update of step ``t`` uses step ``t``'s LR);
- 2BW: step ``t``'s gradient, taken at ``W(max(t - 1, 0))``, updates ``W(t)`` with step
  ``t``'s LR.

Weights and losses agree within 1e-5 after several steps, and every stage's scheduler has
stepped as often as the reference's (same last LR). References with the rule broken (no
delay for 2BW, no stashing for PipeDream, the schedule stepped per update or one step
late) do not agree: the comparison can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers.async_jobs import DEPTH, WIDTH, batches, reference_model, stage_of_layers
from helpers.distributed import run_workers

pytestmark = pytest.mark.distributed

STEPS, BATCH, M, K = 6, 8, 4, 2
WARMUP = 2
LR = 0.02
TOLERANCE = 1e-5
SCHEDULES = ("1f1b", "pipedream", "2bw")

Params = dict[str, torch.Tensor]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _lr_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    from pipetrain.api.lr_schedule import lr_factor

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(WARMUP, STEPS))


def adamw_job(ctx: Any, schedules: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each schedule on ``K`` ranks: trained, drained; weights, losses, schedulers."""
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models import mlp_layer_factories

    torch.set_default_dtype(torch.float64)
    results = []
    for schedule in schedules:
        pipe = Pipeline(mlp_layer_factories(width=WIDTH, depth=DEPTH, activation="gelu", seed=0),
                        loss_fn=F.mse_loss, optimizer=_adamw, lr_scheduler=_lr_schedule,
                        config=PipelineConfig(schedule=schedule, num_stages=K, num_microbatches=M,
                                              nonfinite="ignore"), context=ctx)
        losses = [pipe.train_step(x, y) for x, y in batches(STEPS, BATCH)]
        pipe.drain()
        results.append({
            "params": {k: v.detach().clone() for k, v in pipe.named_parameters().items()},
            "losses": losses,
            "schedulers": {j: (s.last_epoch, s.get_last_lr()) for j, s in
                           pipe.optimizers.schedulers.items()},
        })
        pipe.close()
    return results


# -- the single-process references ----------------------------------------------------------
def _snapshot(model: nn.Module) -> Params:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _gradients(model: nn.Module, weights: Params, pieces: list[tuple[torch.Tensor, torch.Tensor]],
               total: int) -> tuple[float, list[torch.Tensor]]:
    """The loss (each piece's mean loss weighted by its share of ``total`` samples) at
    ``weights`` and its gradient, one tensor per parameter of ``model``."""
    leaves = {name: t.clone().requires_grad_() for name, t in weights.items()}
    loss = sum(F.mse_loss(torch.func.functional_call(model, leaves, (x,)), y) * len(x) / total
               for x, y in pieces)
    assert isinstance(loss, torch.Tensor)
    return loss.item(), list(torch.autograd.grad(loss, list(leaves.values())))


def _apply(model: nn.Module, grads: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    optimizer.step()
    optimizer.zero_grad()


def reference(rule: str, *, delay: bool = True, stash: bool = True, per_update: bool = False,
              late: bool = False) -> dict[str, Any]:
    """``rule`` (``1f1b``, ``pipedream``, ``2bw``) with AdamW and the LR schedule, in one
    process; the switches break it: ``delay=False`` 2BW without its one-step delay,
    ``stash=False`` PipeDream on the current weights, ``per_update`` the schedule stepped
    after every update, ``late`` the schedule stepped before the step's update."""
    model = reference_model()
    stages = stage_of_layers(K)
    optimizer = _adamw(model.parameters())
    scheduler = _lr_schedule(optimizer)
    history = [_snapshot(model)]  # the weights after 0, 1, ... updates
    losses, i = [], 0
    for x, y in batches(STEPS, BATCH):
        if late:
            scheduler.step()
        if rule == "pipedream":
            step_loss = 0.0
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                weights = {name: history[max(0, i - (K - 1 - stages[int(name.split(".")[0])]))
                                         if stash else -1][name] for name in history[0]}
                loss, grads = _gradients(model, weights, [(xm, ym)], len(xm))
                _apply(model, grads, optimizer)
                history.append(_snapshot(model))
                step_loss += loss * len(xm) / len(x)
                i += 1
                if per_update:
                    scheduler.step()
            losses.append(step_loss)
        else:
            at = max(len(history) - 2, 0) if rule == "2bw" and delay else len(history) - 1
            loss, grads = _gradients(model, history[at], list(zip(x.chunk(M), y.chunk(M))), len(x))
            _apply(model, grads, optimizer)
            history.append(_snapshot(model))
            losses.append(loss)
        if not (per_update or late):
            scheduler.step()
    return {"params": {f"layers.{k}": v for k, v in _snapshot(model).items()}, "losses": losses,
            "scheduler": (scheduler.last_epoch, scheduler.get_last_lr())}


# -- the comparison ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    outcome = run_workers(adamw_job, K, SCHEDULES, timeout=300)
    return {schedule: [rank[s] for rank in outcome] for s, schedule in enumerate(SCHEDULES)}


def _distance(results: list[dict[str, Any]], expected: dict[str, Any]) -> float:
    """The largest difference of a weight or a loss between the pipeline and ``expected``."""
    params: Params = {}
    for rank in results:
        params.update(rank["params"])
    assert set(params) == set(expected["params"])
    weights = max(float((params[k] - expected["params"][k]).abs().max()) for k in params)
    losses = max(abs(float(a) - float(b)) for a, b in zip(results[0]["losses"], expected["losses"]))
    return max(weights, losses)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_adamw_and_lr_schedule_follow_the_schedules_rule(
        runs: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    expected = reference(schedule)
    assert _distance(runs[schedule], expected) < TOLERANCE, schedule
    epoch, lrs = expected["scheduler"]
    assert epoch == STEPS
    for rank in runs[schedule]:
        assert rank["schedulers"], "every rank's stage has a scheduler"
        for j, (stage_epoch, stage_lrs) in rank["schedulers"].items():
            assert stage_epoch == epoch, (schedule, j)
            assert stage_lrs == pytest.approx(lrs[:1] * len(stage_lrs), abs=1e-15), (schedule, j)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize(("schedule", "broken"), [
    ("2bw", {"delay": False}),
    ("2bw", {"late": True}),
    ("pipedream", {"stash": False}),
    ("pipedream", {"per_update": True}),
    ("1f1b", {"late": True}),
])
def test_a_reference_with_the_rule_broken_does_not_match(
        runs: dict[str, list[dict[str, Any]]], schedule: str, broken: dict[str, bool]) -> None:
    assert _distance(runs[schedule], reference(schedule, **broken)) > 100 * TOLERANCE


def test_2bw_and_pipedream_differ_from_1f1b(runs: dict[str, list[dict[str, Any]]]) -> None:
    synchronous = reference("1f1b")
    for schedule in ("2bw", "pipedream"):
        assert _distance(runs[schedule], synchronous) > 100 * TOLERANCE, schedule
