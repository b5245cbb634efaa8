"""Case ``async_convergence``: asynchronous schedules vs synchronous 1F1B on the default language-model task.

The model and data of ``pipetrain train`` (a byte-level GPT: 4 blocks, width 64, 4 heads,
context 128; the Python standard library's source; batches of 32 sequences drawn by step;
AdamW, betas (0.9, 0.95), weight decay 0.1; linear warm-up then a cosine to 0.1 of the
peak), trained three ways in the same processes (``stages`` ranks, gloo, 1 thread
each), from the same weights on the same batches:

- ``1f1b``: synchronous, as ``pipetrain train`` runs it (tied embeddings, gradient
  clipping at 1.0);
- ``pipedream`` and ``2bw``: asynchronous (no flush; one update per micro-batch, resp.
  per step with a one-step delay). They train the GPT with untied embeddings and without
  clipping, as ``pipetrain train --schedule pipedream|2bw`` does. PipeDream applies
  ``M`` updates per step, with the same learning rate (``lr_scale`` multiplies it).

The three runners take their steps in turn (interleaved: step ``t`` of every runner runs
before step ``t + 1`` of any), so the machine's load falls on all alike. Each step is
timed on every rank (``perf_counter`` around ``train_step``, after a barrier); a step's
time is the slowest rank's. Reported per runner: the median step time after ``skip``
warm-up steps and the throughput ratio to 1F1B's (above 1: faster); the mean training
loss of the last tenth of the steps; and the validation loss (the same ``val_batches``
validation batches for all, after a drain) with its ratio to 1F1B's. Full size: 300
steps, 2 stages, 8 micro-batches; ``--quick``: 20 steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.harness import run_job

__all__ = ["CASE", "RUNNERS", "Options", "job", "run", "summarize"]

RUNNERS = ("1f1b", "pipedream", "2bw")


@dataclass(frozen=True, kw_only=True)
class Options:
    """One comparison: the steps, the pipeline, the optimizer's schedule, the runners."""

    steps: int = 300
    stages: int = 2
    microbatches: int = 8
    batch_size: int = 32
    lr: float = 1e-2
    """The peak learning rate."""
    warmup: int = 50
    lr_scale: dict[str, float] = field(default_factory=lambda: {"pipedream": 1.0, "2bw": 1.0})
    """A runner's peak LR = ``lr`` times this."""
    clip: float | None = 1.0
    """1F1B's gradient clipping, as ``pipetrain train --clip``."""
    skip: int = 5
    """Steps left out of the timing."""
    val_batches: int = 8
    runners: tuple[str, ...] = RUNNERS


FULL = Options()
QUICK = replace(FULL, steps=20, warmup=5, skip=3, val_batches=2)


def _lr_factor(warmup: int, total: int) -> Callable[[int], float]:
    from pipetrain.cli.train_job import lr_factor

    factor: Callable[[int], float] = lr_factor(warmup, total)
    return factor


def _pipeline(ctx: Any, name: str, options: Options) -> Any:
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss, gpt_ties

    asynchronous = name != "1f1b"
    model = GPTConfig(context=128, num_layers=4, width=64, num_heads=4, dropout=0.0,
                      tie_embeddings=not asynchronous)
    lr = options.lr * options.lr_scale.get(name, 1.0)
    config = PipelineConfig(schedule=name, num_stages=options.stages,
                            num_microbatches=options.microbatches,
                            clip_grad_norm=None if asynchronous else options.clip,
                            nonfinite="ignore" if asynchronous else "error", seed=0)
    return Pipeline(
        gpt_layer_factories(model, seed=0), loss_fn=gpt_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), fused=True,
                                                   weight_decay=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, _lr_factor(options.warmup, options.steps)),
        ties=gpt_ties(model), config=config, context=ctx)


def job(ctx: Any, options: Options) -> dict[str, Any]:
    """Every runner, interleaved step by step (in each rank)."""
    from pipetrain.data import TextDataset, load_corpus

    dataset = TextDataset(load_corpus(None), context=128, seed=0)
    pipes = {name: _pipeline(ctx, name, options) for name in options.runners}
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(options.steps):
        inputs, targets = dataset.batch(step, options.batch_size)
        for name, pipe in pipes.items():
            dist.barrier()
            began = time.perf_counter()
            losses[name].append(pipe.train_step(inputs, targets))
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds[name].append(float(elapsed))
    val: dict[str, float] = {}
    for name, pipe in pipes.items():
        pipe.drain()
        batches = [dataset.batch(k, options.batch_size, split="val")
                   for k in range(options.val_batches)]
        val[name] = statistics.fmean(pipe.eval_step(x, y) for x, y in batches)
        pipe.close()
    return {"seconds": seconds, "losses": losses, "val": val}


def summarize(result: dict[str, Any], options: Options) -> dict[str, Any]:
    """Per runner: median step, last-tenth training loss, validation loss, and the
    ratios to 1F1B's.

    Example:
        >>> out = summarize({"seconds": {"1f1b": [2.0, 2.0], "2bw": [1.0, 1.0]},
        ...                  "losses": {"1f1b": [3.0, 2.0], "2bw": [3.0, 2.2]},
        ...                  "val": {"1f1b": 2.0, "2bw": 2.1}},
        ...                 Options(steps=2, skip=0, runners=("1f1b", "2bw")))
        >>> out["runners"]["2bw"]["throughput_vs_1f1b"], round(out["runners"]["2bw"]["val_loss_vs_1f1b"], 2)
        (2.0, 1.05)
    """
    skip, steps = options.skip, options.steps
    tail = max(1, steps // 10)
    rows = {}
    for name in options.runners:
        timed = result["seconds"][name][skip:] or result["seconds"][name]
        rows[name] = {"median_step_seconds": statistics.median(timed),
                      "train_loss_last_tenth": statistics.fmean(result["losses"][name][-tail:]),
                      "val_loss": result["val"][name]}
    anchor = rows.get("1f1b")
    for row in rows.values():
        if anchor is not None:
            row["throughput_vs_1f1b"] = anchor["median_step_seconds"] / row["median_step_seconds"]
            row["val_loss_vs_1f1b"] = row["val_loss"] / anchor["val_loss"]
    samples = steps * options.batch_size
    return {"options": asdict(options), "samples": samples, "runners": rows,
            "losses": result["losses"]}


def run(context: BenchContext) -> BenchResult:
    """Train the three runners interleaved in one job; the table of their figures."""
    options = QUICK if context.quick else FULL
    options = replace(options, warmup=min(options.warmup, options.steps),
                      skip=min(options.skip, max(options.steps - 1, 0)))
    context.progress(f"{options.stages} stages, {options.steps} steps of "
                     f"{options.batch_size} sequences, runners {', '.join(options.runners)}")
    result = run_job(job, options, world_size=options.stages, timeout=7200)[0]
    summary = summarize(result, options)
    table = Table(
        title=f"Asynchronous schedules vs 1F1B: default LM task, {options.stages} stages x 1 "
              f"thread, {options.steps} steps of {options.batch_size} sequences, "
              f"M = {options.microbatches}",
        columns=["schedule", "median step ms", "throughput / 1f1b", "train loss (last tenth)",
                 "val loss", "val loss / 1f1b"],
        rows=[[name, round(row["median_step_seconds"] * 1e3, 1),
               round(row.get("throughput_vs_1f1b", float("nan")), 3),
               round(row["train_loss_last_tenth"], 4), round(row["val_loss"], 4),
               round(row.get("val_loss_vs_1f1b", float("nan")), 3)]
              for name, row in summary["runners"].items()],
        anchor="1f1b (synchronous, tied embeddings, clipping 1.0, as pipetrain train runs "
               "it), in the same processes, interleaved step by step, same weights and batches",
        notes=f"Peak LR {options.lr:g} for all (PipeDream x "
              f"{options.lr_scale['pipedream']:g}, 2BW x {options.lr_scale['2bw']:g}); "
              "pipedream and 2bw train untied and unclipped, as pipetrain train does for "
              "them. Throughput above 1 is faster than 1F1B.",
        key="convergence")
    return BenchResult(tables=[table], data=summary)


CASE = Case(name="async_convergence", title="PipeDream and 2BW vs synchronous 1F1B: loss and speed",
            run=run, quick_seconds=20, full_seconds=300)
