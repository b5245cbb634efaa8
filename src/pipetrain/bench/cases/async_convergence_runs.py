"""The runs of case ``async_convergence``: runners side by side, judged on their checkpoints' weights.

A *runner* is a way to train the default language-model task (:data:`RUNNERS`); a
*setting* (:class:`Setting`) is one training run of some runners with the same steps,
warm-up and peak learning rate. :func:`job` runs every setting in turn in the same
processes: the runners of a setting take their steps in turn (step ``t`` of every runner
before step ``t + 1`` of any), from the same weights on the same batches, each step
timed on every rank (``perf_counter`` around ``train_step`` after a barrier; a step's
time is the slowest rank's).

After its last step a runner is saved with :meth:`Pipeline.save
<pipetrain.api.pipeline.Pipeline.save>` (which drains an asynchronous pipeline first),
the checkpoint is loaded into a synchronous pipeline of the same model
(:meth:`Pipeline.load <pipetrain.api.pipeline.Pipeline.load>`), and that pipeline
measures the validation loss: every runner is judged on the model weights its
checkpoint holds, picked by the checkpoint code itself (for 2BW the live weights
``W(T)``, with all ``T`` updates applied; its own ``eval_step`` would use ``W(T - 1)``,
the version its next forward uses, which the checkpoint keeps beside them).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CONTEXT", "RUNNERS", "Options", "Runner", "Setting", "job", "lr_of"]

CONTEXT = 128
"""Tokens per sequence (``pipetrain train``'s default)."""


@dataclass(frozen=True, kw_only=True)
class Runner:
    """How a runner trains the GPT: its schedule, tied or untied embeddings, and
    whether it clips gradients (at :attr:`Options.clip`)."""

    schedule: str
    tied: bool
    clipped: bool


RUNNERS: dict[str, Runner] = {
    "1f1b": Runner(schedule="1f1b", tied=True, clipped=True),
    "1f1b-untied": Runner(schedule="1f1b", tied=False, clipped=False),
    "pipedream": Runner(schedule="pipedream", tied=False, clipped=False),
    "2bw": Runner(schedule="2bw", tied=False, clipped=False),
}
"""``1f1b`` as ``pipetrain train`` runs it (tied, clipped); ``1f1b-untied`` with the
asynchronous runners' settings (untied embeddings, no clipping), their equal."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """The case's sizes: the comparison of every runner (``steps``, ``lr``), the sweep
    of 2BW against ``1f1b-untied`` (``sweep_steps`` x ``sweep_lrs``), the pipeline, the
    optimizer's schedule, the timing and the evaluation.

    Example:
        >>> Options(steps=20, warmup=5).warmup_for(10)
        2
        >>> Options(runners=("1f1b", "nope"), batch_size=30)
        Traceback (most recent call last):
        ...
        ValueError: unknown runners ['nope'] (known: 1f1b, 1f1b-untied, pipedream, 2bw); batch_size=30 is not a multiple of microbatches=8, e.g. batch_size=32
    """

    steps: int = 300
    stages: int = 2
    microbatches: int = 8
    batch_size: int = 32
    lr: float = 1e-2
    """The peak learning rate of the comparison of every runner."""
    warmup: int = 50
    """Warm-up steps of a run of ``steps`` steps (a run of ``n`` steps: in proportion)."""
    lr_scale: dict[str, float] = field(default_factory=lambda: {"pipedream": 1.0, "2bw": 1.0})
    """A runner's peak LR = the setting's times this."""
    clip: float = 1.0
    """The gradient clipping of runner ``1f1b``, as ``pipetrain train --clip``."""
    skip: int = 5
    """Steps left out of the timing."""
    val_batches: int = 8
    runners: tuple[str, ...] = tuple(RUNNERS)
    sweep_steps: tuple[int, ...] = (100, 300)
    sweep_lrs: tuple[float, ...] = (1e-2, 3e-3, 1e-3, 3e-4)
    threshold: float = 0.02
    """The gap to ``1f1b-untied`` that counts as "within" (2%)."""

    def __post_init__(self) -> None:
        problems = []
        unknown = [name for name in self.runners if name not in RUNNERS]
        if unknown:
            problems.append(f"unknown runners {unknown} (known: {', '.join(RUNNERS)})")
        if self.batch_size % self.microbatches:
            problems.append(f"batch_size={self.batch_size} is not a multiple of microbatches="
                            f"{self.microbatches}, e.g. batch_size="
                            f"{-(-self.batch_size // self.microbatches) * self.microbatches}")
        counts = {"steps": self.steps, "stages": self.stages, "val_batches": self.val_batches,
                  "warmup": self.warmup}
        problems += [f"{name}={value!r} must be a positive int" for name, value in counts.items()
                     if not isinstance(value, int) or value < 1]
        if self.sweep_steps and any(s < 1 for s in self.sweep_steps):
            problems.append(f"sweep_steps={self.sweep_steps} must be positive")
        if problems:
            raise ValueError("; ".join(problems))

    def warmup_for(self, steps: int) -> int:
        """The warm-up of a run of ``steps`` steps: ``warmup`` scaled by ``steps / self.steps``
        (at least 1, at most ``steps``)."""
        return min(steps, max(1, round(self.warmup * steps / self.steps)))


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One training run of some runners, alike in everything but the runner.

    Example:
        >>> Setting(steps=100, warmup=17, lr=1e-3, runners=("1f1b-untied", "2bw")).label
        '100 steps, peak LR 0.001'
    """

    steps: int
    warmup: int
    lr: float
    runners: tuple[str, ...]

    @property
    def label(self) -> str:
        """The setting in words."""
        return f"{self.steps} steps, peak LR {self.lr:g}"


def lr_of(name: str, setting: Setting, options: Options) -> float:
    """Runner ``name``'s peak learning rate in ``setting``.

    Example:
        >>> lr_of("2bw", Setting(steps=1, warmup=1, lr=0.01, runners=("2bw",)),
        ...       Options(lr_scale={"2bw": 0.5}))
        0.005
    """
    return setting.lr * options.lr_scale.get(name, 1.0)


def _lr_factor(warmup: int, total: int) -> Callable[[int], float]:
    from pipetrain.api.lr_schedule import lr_factor

    factor: Callable[[int], float] = lr_factor(warmup, total)
    return factor


def _pipeline(ctx: Any, name: str, setting: Setting, options: Options) -> Any:
    """Runner ``name`` of ``setting``: the GPT of ``pipetrain train`` (4 blocks, width 64,
    4 heads), AdamW (betas 0.9, 0.95, weight decay 0.1), warm-up then cosine."""
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss, gpt_ties

    runner = RUNNERS[name]
    model = GPTConfig(context=CONTEXT, num_layers=4, width=64, num_heads=4, dropout=0.0,
                      tie_embeddings=runner.tied)
    lr = lr_of(name, setting, options)
    synchronous = runner.schedule == "1f1b"
    config = PipelineConfig(schedule=runner.schedule, num_stages=options.stages,
                            num_microbatches=options.microbatches,
                            clip_grad_norm=options.clip if runner.clipped else None,
                            nonfinite="error" if synchronous else "ignore", seed=0)
    return Pipeline(
        gpt_layer_factories(model, seed=0), loss_fn=gpt_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), fused=True,
                                                   weight_decay=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, _lr_factor(setting.warmup, setting.steps)),
        ties=gpt_ties(model), config=config, context=ctx)


def _train(pipes: dict[str, Any], setting: Setting, dataset: Any,
           batch_size: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Every runner of ``setting``, interleaved step by step: seconds and losses per step."""
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(setting.steps):
        inputs, targets = dataset.batch(step, batch_size)
        for name, pipe in pipes.items():
            dist.barrier()
            began = time.perf_counter()
            losses[name].append(pipe.train_step(inputs, targets))
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds[name].append(float(elapsed))
    return seconds, losses


def job(ctx: Any, options: Options, settings: list[Setting], scratch: str) -> dict[str, Any]:
    """Every setting in turn (in each rank): its runners trained interleaved, then each
    saved to a checkpoint under ``scratch`` (a folder every rank sees) and evaluated on
    the weights that checkpoint holds (see the module doc).

    Returns, per setting (in order): ``seconds`` and ``losses`` per runner and step,
    ``val`` (the validation loss on the checkpoint's weights) and ``own_eval`` (the
    runner's own ``eval_step`` before the save, for the first setting only).

    Example::

        result = run_job(job, options, settings(options), scratch, world_size=options.stages)[0]
        result["runs"][0]["val"]["2bw"]   # 2BW's validation loss on W(T)
    """
    from pipetrain.data import TextDataset, load_corpus

    dataset = TextDataset(load_corpus(None), context=CONTEXT, seed=0)
    validation = [dataset.batch(k, options.batch_size, split="val")
                  for k in range(options.val_batches)]
    evaluators: dict[bool, Any] = {}  # a synchronous pipeline per tie setting
    runs = []
    for index, setting in enumerate(settings):
        pipes = {name: _pipeline(ctx, name, setting, options) for name in setting.runners}
        seconds, losses = _train(pipes, setting, dataset, options.batch_size)
        own: dict[str, float] = {}
        val: dict[str, float] = {}
        for name, pipe in pipes.items():
            if index == 0:
                own[name] = statistics.fmean(pipe.eval_step(x, y) for x, y in validation)
            path = os.path.join(scratch, f"setting-{index}-{name}")
            pipe.save(path)
            pipe.close()
            tied = RUNNERS[name].tied
            if tied not in evaluators:
                evaluators[tied] = _pipeline(ctx, "1f1b" if tied else "1f1b-untied", setting,
                                             options)
            evaluators[tied].load(path)
            val[name] = statistics.fmean(evaluators[tied].eval_step(x, y) for x, y in validation)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
        runs.append({"seconds": seconds, "losses": losses, "val": val, "own_eval": own})
    for evaluator in evaluators.values():
        evaluator.close()
    return {"runs": runs}
