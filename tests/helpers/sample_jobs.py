"""A GPT trained on documents of 16-128 tokens (packed, packed with their boundaries kept,
or padded per step) through a Pipeline, and the same in one process: workers for
tests/api/test_pipeline_samples.py."""

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


LAYOUTS = {"packed": {"pack": True}, "padded": {"pack": False},
           "documents": {"pack": True, "boundaries": True}}
"""How the documents become rows: SampleDataset's arguments."""


def dataset(layout: str) -> SampleDataset:
    return SampleDataset(documents(), context=GPT.context, seed=1, val_fraction=0,
                         **LAYOUTS[layout])


def batches(layout: str, steps: int) -> list[tuple[Any, torch.Tensor]]:
    data = dataset(layout)
    return [data.batch(step, BATCH) for step in range(steps)]


def samples_reference(layout: str, steps: int) -> tuple[Params, list[float]]:
    return _train_reference(build_gpt(GPT, seed=3), batches(layout, steps), gpt_loss, clip=0.5)


def samples_job(ctx: Any, runs: list[tuple[str, dict[str, Any]]],
                steps: int) -> list[tuple[Params, list[float]]]:
    """Each run: (layout, PipelineConfig's arguments); its weights and losses."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for layout, config in runs:
        pipe = Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd,
                        ties=gpt_ties(GPT), context=ctx,
                        config=PipelineConfig(clip_grad_norm=0.5, **config))
        losses = [pipe.train_step(x, y) for x, y in batches(layout, steps)]
        results.append((_snapshot(pipe), losses))
        pipe.close()
    return results


def samples_resume_job(ctx: Any, config: dict[str, Any], layout: str, path: str,
                       steps: int) -> tuple[list[float], list[float]]:
    """``steps`` straight, and the same in two sessions (a save after the first step, a new
    Pipeline loading it): both sessions' losses, each step's batch from the dataset."""
    from pipetrain.api.pipeline import Pipeline

    def pipeline() -> Any:
        return Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd,
                        ties=gpt_ties(GPT), context=ctx,
                        config=PipelineConfig(clip_grad_norm=0.5, **config))

    data = dataset(layout)
    straight = pipeline()
    whole = [straight.train_step(*data.batch(step, BATCH)) for step in range(steps)]
    straight.close()
    first = pipeline()
    resumed = [first.train_step(*data.batch(0, BATCH))]
    first.save(path)
    first.close()
    second = pipeline()
    second.load(path)
    fresh = dataset(layout)  # a new process's dataset: the step alone says what it holds
    resumed += [second.train_step(*fresh.batch(step, BATCH)) for step in range(second.step, steps)]
    second.close()
    return whole, resumed


def hf_documents(layout: str, steps: int) -> list[tuple[Any, torch.Tensor]]:
    """Batches of the documents for Hugging Face GPT-2's vocabulary of 256 and context 64."""
    data = SampleDataset(documents(), context=64, seed=1, val_fraction=0, **LAYOUTS[layout])
    return [data.batch(step, BATCH) for step in range(steps)]


def hf_documents_reference(layout: str, steps: int) -> tuple[Params, list[float]]:
    """One process: GPT-2 trained on the batches (a dict of inputs as keyword arguments)."""
    from helpers.frontend_jobs import hf_model, lm_loss
    from helpers.frontend_jobs import sgd as hf_sgd

    model = hf_model("gpt2")
    optimizer = hf_sgd(model.parameters())
    losses = []
    for x, y in hf_documents(layout, steps):
        loss = lm_loss(model(**x, use_cache=False) if isinstance(x, dict) else model(x, use_cache=False), y)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def hf_documents_job(ctx: Any, config: dict[str, Any], steps: int) -> tuple[Params, list[float]]:
    """GPT-2 captured on a batch of packed documents with their boundaries (input_ids and
    position_ids as keyword arguments), cut after its second block, trained on them."""
    from helpers.frontend_jobs import SPLITS, hf_model, lm_loss
    from helpers.frontend_jobs import sgd as hf_sgd
    from pipetrain.api.pipeline import Pipeline

    steps_batches = hf_documents("documents", steps)
    pipe = Pipeline(hf_model("gpt2"), example_kwargs={**steps_batches[0][0], "use_cache": False},
                    split_points=SPLITS["gpt2"][2], loss_fn=lm_loss, optimizer=hf_sgd,
                    config=PipelineConfig(**config), context=ctx)
    losses = [pipe.train_step(x, y) for x, y in steps_batches]
    result = {k: v.clone() for k, v in pipe.state_dict().items()}, losses
    pipe.close()
    return result
