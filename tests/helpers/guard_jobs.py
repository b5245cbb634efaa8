"""Worker functions for the tests of a step's guards: non-finite steps, batch sizes,
small evaluation batches, and checkpoints that survive interrupted saves."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig
from pipetrain.models import mlp_layer_factories

WIDTH = 8


def _pipeline(ctx: Any, **config: Any) -> Any:
    from pipetrain.api.pipeline import Pipeline

    return Pipeline(mlp_layer_factories(width=WIDTH, depth=4, seed=0), loss_fn=F.mse_loss,
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                    lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
                    config=PipelineConfig(**config), context=ctx)


def _weights(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nonfinite_job(ctx: Any) -> dict[str, Any]:
    """A good step, then a batch with a NaN, under ``nonfinite='error'`` and ``'skip'``."""
    from pipetrain.api.grad_check import NonFiniteError

    g = torch.Generator().manual_seed(0)
    good = torch.randn(8, WIDTH, generator=g)
    bad = good.clone()
    bad[3, 2] = float("nan")
    found: dict[str, Any] = {}

    pipe = _pipeline(ctx, num_stages=2, num_microbatches=4)
    pipe.train_step(good, good)
    before, lr_before = _weights(pipe), pipe.optimizers.optimizers[min(pipe.local_stages)].param_groups[0]["lr"]
    try:
        pipe.train_step(bad, good)
        found["error"] = None
    except NonFiniteError as error:
        found["error"] = (str(error), error.step)
    found["error_kept_weights"] = _same(before, _weights(pipe))
    found["error_step"] = pipe.step
    found["error_lr_kept"] = pipe.optimizers.optimizers[min(pipe.local_stages)].param_groups[0]["lr"] == lr_before
    pipe.train_step(good, good)  # the pipeline goes on after the error
    found["after_error_moved"] = not _same(before, _weights(pipe))
    pipe.close()

    pipe = _pipeline(ctx, num_stages=2, num_microbatches=4, nonfinite="skip", clip_grad_norm=1.0)
    pipe.train_step(good, good)
    before = _weights(pipe)
    loss = pipe.train_step(bad, good)
    found["skip"] = (loss != loss, pipe.last_step_skipped, pipe.step, _same(before, _weights(pipe)))
    pipe.train_step(good, good)
    found["skip_then"] = (pipe.last_step_skipped, _same(before, _weights(pipe)), pipe.grad_norm)
    pipe.close()
    return found


def batch_size_job(ctx: Any) -> dict[str, Any]:
    """A first batch too small for the micro-batches, then a good one, then a smaller last one."""
    found: dict[str, Any] = {}
    pipe = _pipeline(ctx, num_stages=2, num_microbatches=8)
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(0))
    try:
        pipe.train_step(x[:2], x[:2])
        found["small_first"] = None
    except ValueError as error:
        found["small_first"] = str(error)
    found["step_after_refusal"] = pipe.step
    pipe.train_step(x, x)
    pipe.train_step(x[:3], x[:3])  # the last batch of an epoch: fewer micro-batches
    found["steps"] = pipe.step
    pipe.close()
    return found


def small_eval_job(ctx: Any) -> dict[str, Any]:
    """Evaluation batches smaller than the number of replicas (2 replicas of 1 stage)."""
    pipe = _pipeline(ctx, num_stages=1, replicas=2, num_microbatches=2)
    x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(0))
    one = pipe.eval_step(x[:1], broadcast=True)
    loss = pipe.eval_step(x[:1], x[:1])
    model = torch.nn.Sequential(*(f() for f in mlp_layer_factories(width=WIDTH, depth=4, seed=0)))
    with torch.no_grad():
        expected = model(x[:1])
    found = {"output": one, "expected": expected, "loss": loss,
             "expected_loss": float(F.mse_loss(expected, x[:1]))}
    pipe.close()
    return found


def leftover_save_job(ctx: Any, folder: str) -> dict[str, Any]:
    """Saves after every kind of leftover an interrupted save can leave behind (the
    two newest checkpoints kept: ``checkpoint`` and ``checkpoint.step-S``)."""
    from pipetrain.api.checkpointing import find_checkpoint

    path = os.path.join(folder, "checkpoint")
    pipe = _pipeline(ctx, num_stages=1, num_microbatches=2)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    found: dict[str, Any] = {}

    pipe.train_step(x, x)
    pipe.save(path, extra={"at": 1})
    # an earlier version's cleanup cut short: half of checkpoint.previous deleted
    os.makedirs(path + ".previous")
    with open(os.path.join(path + ".previous", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    pipe.train_step(x, x)
    pipe.save(path, extra={"at": 2})
    found["after_half_deleted_previous"] = sorted(os.listdir(folder))

    # killed between the two renames: checkpoint/ (step 2) set aside as checkpoint.step-2,
    # the new one (step 3) complete in checkpoint.partial
    pipe.train_step(x, x)
    pipe.save(os.path.join(folder, "scratch"), extra={"at": 3}, keep=1)
    os.replace(path, path + ".step-2")
    os.replace(os.path.join(folder, "scratch"), path + ".partial")
    found["found_between_renames"] = os.path.basename(find_checkpoint(path) or "")
    found["loaded_between_renames"] = pipe.load(path)
    pipe.train_step(x, x)
    pipe.save(path, extra={"at": 4})
    found["after_between_renames"] = sorted(os.listdir(folder))

    # an earlier version killed between its renames: the checkpoint in checkpoint.previous
    os.replace(path, path + ".previous")
    found["found_previous"] = os.path.basename(find_checkpoint(path) or "")
    pipe.train_step(x, x)
    pipe.save(path, extra={"at": 5})
    found["after_previous"] = sorted(os.listdir(folder))

    # killed after writing .partial completely, before any rename
    shutil.copytree(path, path + ".partial")
    shutil.rmtree(path)
    found["found_partial"] = os.path.basename(find_checkpoint(path) or "")
    pipe.train_step(x, x)
    pipe.save(path, extra={"at": 6})
    found["after_partial"] = sorted(os.listdir(folder))
    found["final_extra"] = pipe.load(path)
    pipe.close()
    return found


def paramless_stage_job(ctx: Any) -> dict[str, Any]:
    """Stage 0 is a parameter-free layer (nothing to optimize there)."""
    from pipetrain.api.pipeline import Pipeline

    pipe = Pipeline([torch.nn.Tanh, seeded_linear], loss_fn=F.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    config=PipelineConfig(num_stages=2, num_microbatches=2), context=ctx)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    losses = [pipe.train_step(x, x) for _ in range(2)]
    found = {"losses": losses, "lr": pipe.optimizers.learning_rate,
             "weights": {k: v.detach().clone() for k, v in pipe.named_parameters().items()}}
    pipe.close()
    return found


def seeded_linear() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return torch.nn.Linear(WIDTH, WIDTH)


class ToDict(torch.nn.Module):
    """A last layer that returns a dict, which ``mse_loss`` cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.proj(x)}


def nontensor_output_job(ctx: Any) -> str:
    """The error of a last stage whose output the loss function cannot take."""
    from pipetrain.api.pipeline import Pipeline

    pipe = Pipeline([seeded_linear, ToDict], loss_fn=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    config=PipelineConfig(num_stages=2, num_microbatches=2, heartbeat_timeout=5.0),
                    context=ctx)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    try:
        pipe.train_step(x, x)
    except Exception as error:
        notes = "\n".join(getattr(error, "__notes__", []))
        return f"{type(error).__name__}: {error}\n{notes}"
    finally:
        pipe.close()
    return "no error"
