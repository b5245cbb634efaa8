"""A small Hugging Face Llama as pipeline layers (:mod:`pipetrain.models.llama_layers`):
its batches, its one-process reference and the worker of the tensor-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from helpers.mesh_jobs import full_parameters
from helpers.pipeline_jobs import sgd
from pipetrain.api.config import PipelineConfig

VOCAB = 64
CLIP = 0.5
Params = dict[str, torch.Tensor]


def llama() -> nn.Module:
    """4 query heads and 2 key-value heads (grouped-query attention), 2 decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (4, (12, 7)[step % 2] + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference(steps: int) -> tuple[Params, list[float]]:
    """One process: the model's layers in sequence (names ``layers.<index>.<name>``)."""
    from pipetrain.models.llama_layers import llama_layers

    model = nn.Sequential(*(factory() for factory in llama_layers(llama())))
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches(steps):
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {f"layers.{k}": v.detach().clone() for k, v in model.state_dict().items()}, losses


def tp_job(ctx: Any, configs: list[dict[str, Any]],
           steps: int) -> list[tuple[Params, list[float], list[str]]]:
    """Train each configuration ``steps`` steps with the Llama plan; whole parameters,
    losses, and the names of the parameters split over ``tp``."""
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models.llama_layers import llama_layers, llama_tensor_parallel_plan

    results = []
    for config in configs:
        pipe = Pipeline(llama_layers(llama()), loss_fn=loss_fn, optimizer=sgd,
                        config=PipelineConfig(clip_grad_norm=CLIP, **config), context=ctx,
                        tensor_parallel_plan=llama_tensor_parallel_plan)
        losses = [pipe.train_step(x, y) for x, y in batches(steps)]
        split = [name for name, p in pipe.named_parameters().items()
                 if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                 and p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard()]
        results.append((full_parameters(pipe), losses, split))
        pipe.close()
    return results
