"""A GPT trained on documents of 16-128 tokens (packed, or padded per step) through a
Pipeline, and the same in one process: workers for tests/api/test_pipeline_samples.py."""

from __future__ import annotations

from typing import Any

import torch

from helpers.pipeline_jobs import Params, _snapshot, _train_reference, sgd
from pipetrain.api.config import PipelineConfig
from pipetrain.data import SampleDataset
from pipetrain.models import GPTConfig, build_gpt, gpt_layer_factories, gpt_loss, gpt_ties

GPT = GPTConfig(num_layers=3, width=32, num_heads=4, context=64)
BATCH = 6


def documents(count: int = 40, *, seed: int = 5) -> list[torch.Tensor]:
    """``count`` documents of 16 to 128 token ids (of 256)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (count,), generator=g)
    return [torch.randint(0, 256, (int(n),), generator=g) for n in lengths]


def dataset(pack: bool) -> SampleDataset:
    return SampleDataset(documents(), context=GPT.context, seed=1, pack=pack, val_fraction=0)


def batches(pack: bool, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = dataset(pack)
    return [data.batch(step, BATCH) for step in range(steps)]


def samples_reference(pack: bool, steps: int) -> tuple[Params, list[float]]:
    return _train_reference(build_gpt(GPT, seed=3), batches(pack, steps), gpt_loss, clip=0.5)


def samples_job(ctx: Any, runs: list[tuple[bool, dict[str, Any]]],
                steps: int) -> list[tuple[Params, list[float]]]:
    """Each run: (pack, PipelineConfig's arguments); its weights and losses."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for pack, config in runs:
        pipe = Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd,
                        ties=gpt_ties(GPT), context=ctx,
                        config=PipelineConfig(clip_grad_norm=0.5, **config))
        losses = [pipe.train_step(x, y) for x, y in batches(pack, steps)]
        results.append((_snapshot(pipe), losses))
        pipe.close()
    return results


def samples_resume_job(ctx: Any, config: dict[str, Any], pack: bool, path: str,
                       steps: int) -> tuple[list[float], list[float]]:
    """``steps`` straight, and the same in two sessions (a save after the first step, a new
    Pipeline loading it): both sessions' losses, each step's batch from the dataset."""
    from pipetrain.api.pipeline import Pipeline

    def pipeline() -> Any:
        return Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd,
                        ties=gpt_ties(GPT), context=ctx,
                        config=PipelineConfig(clip_grad_norm=0.5, **config))

    data = dataset(pack)
    straight = pipeline()
    whole = [straight.train_step(*data.batch(step, BATCH)) for step in range(steps)]
    straight.close()
    first = pipeline()
    resumed = [first.train_step(*data.batch(0, BATCH))]
    first.save(path)
    first.close()
    second = pipeline()
    second.load(path)
    fresh = dataset(pack)  # a new process's dataset: the step alone says what it holds
    resumed += [second.train_step(*fresh.batch(step, BATCH)) for step in range(second.step, steps)]
    second.close()
    return whole, resumed
