"""Models, batches, single-process references and worker functions for the Pipeline tests.

Worker functions run inside spawned processes (see :mod:`helpers.distributed`), so they
live here, at module level, importable by name.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig
from pipetrain.models import (
    GPTConfig,
    build_gpt,
    build_mlp,
    gpt_layer_factories,
    gpt_loss,
    gpt_ties,
    mlp_layer_factories,
)

Params = dict[str, torch.Tensor]

# -- an MLP -----------------------------------------------------------------------------
MLP_DEPTH = 8
MLP_WIDTH = 16


def mlp_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, MLP_WIDTH, generator=g), torch.randn(batch, MLP_WIDTH, generator=g))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mlp_reference(steps: int, batch: int, clip: float | None = None) -> tuple[Params, list[float]]:
    model = build_mlp(width=MLP_WIDTH, depth=MLP_DEPTH, activation="gelu", seed=0)
    return _train_reference(model, mlp_batches(steps, batch), F.mse_loss, clip=clip)


def _train_reference(model: nn.Module, batches: list[Any], loss_fn: Callable[..., torch.Tensor],
                     clip: float | None) -> tuple[Params, list[float]]:
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {f"layers.{k}": v.detach().clone() for k, v in model.state_dict().items()}, losses


def _snapshot(pipe: Any) -> Params:
    return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}


def mlp_job(ctx: Any, configs: list[dict[str, Any]], steps: int, batch: int) -> list[tuple[Params, list[float]]]:
    from pipetrain.api.pipeline import Pipeline

    results = []
    for config in configs:
        pipe = Pipeline(mlp_layer_factories(width=MLP_WIDTH, depth=MLP_DEPTH, activation="gelu", seed=0),
                        loss_fn=F.mse_loss, optimizer=sgd, config=PipelineConfig(**config), context=ctx)
        losses = [pipe.train_step(x, y) for x, y in mlp_batches(steps, batch)]
        results.append((_snapshot(pipe), losses))
        pipe.close()
    return results


# -- a GPT with tied embeddings and a sequence length that changes every step ------------
GPT = GPTConfig(num_layers=3, width=32, num_heads=4, context=16)
GPT_CLIP = 0.5


def gpt_batches(steps: int, *, batch: int = 7, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + step)
        length = (16, 9, 12, 5)[step % 4]
        tokens = torch.randint(0, 256, (batch, length + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def gpt_reference(steps: int) -> tuple[Params, list[float]]:
    return _train_reference(build_gpt(GPT, seed=3), gpt_batches(steps), gpt_loss, clip=GPT_CLIP)


def make_gpt_pipeline(ctx: Any, config: dict[str, Any]) -> Any:
    from pipetrain.api.pipeline import Pipeline

    return Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd, ties=gpt_ties(GPT),
                    config=PipelineConfig(clip_grad_norm=GPT_CLIP, **config), context=ctx)


def gpt_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[tuple[Params, list[float]]]:
    results = []
    for config in configs:
        pipe = make_gpt_pipeline(ctx, config)
        losses = [pipe.train_step(x, y) for x, y in gpt_batches(steps)]
        results.append((_snapshot(pipe), losses))
        pipe.close()
    return results


def gpt_resume_job(ctx: Any, num_stages: int, path: str, first: int, last: int, save_at: int | None,
                   resume: bool) -> tuple[Params, list[float], Any]:
    pipe = make_gpt_pipeline(ctx, {"num_stages": num_stages, "num_microbatches": 3})
    extra = pipe.load(path) if resume else None
    losses = []
    for step, (x, y) in enumerate(gpt_batches(last - first, first=first), start=first):
        losses.append(pipe.train_step(x, y))
        if save_at is not None and step + 1 == save_at:
            pipe.save(path, extra={"data_step": step + 1})
    result = (_snapshot(pipe), losses, (extra, pipe.step))
    pipe.close()
    return result


# -- a model whose stage boundaries carry a dict with an integer mask --------------------
class MaskedIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": self.proj(batch["x"]), "mask": batch["mask"]}


class MaskedMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.proj(batch["h"])) * batch["mask"].float(), "mask": batch["mask"]}


class MaskedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.proj(batch["h"])


def _seeded(cls: type[nn.Module], index: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index)
            return cls()
    return build


def masked_factories() -> list[Callable[[], nn.Module]]:
    return [_seeded(MaskedIn, 0), _seeded(MaskedMid, 1), _seeded(MaskedMid, 2), _seeded(MaskedOut, 3)]


def masked_batches(steps: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [({"x": torch.randn(9, 8, generator=g), "mask": torch.randint(0, 2, (9, 8), generator=g)},
             torch.randn(9, 3, generator=g)) for _ in range(steps)]


def masked_reference(steps: int) -> tuple[Params, list[float]]:
    model = nn.Sequential(*(f() for f in masked_factories()))
    return _train_reference(model, masked_batches(steps), F.mse_loss, clip=None)


def masked_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[tuple[Params, list[float]]]:
    from pipetrain.api.pipeline import Pipeline

    results = []
    for config in configs:
        pipe = Pipeline(masked_factories(), loss_fn=F.mse_loss, optimizer=sgd,
                        config=PipelineConfig(**config), context=ctx)
        losses = [pipe.train_step(x, y) for x, y in masked_batches(steps)]
        results.append((_snapshot(pipe), losses))
        pipe.close()
    return results


# -- failures -------------------------------------------------------------------------------
def killed_peer_job(ctx: Any, victim: int, kill_step: int) -> tuple[str, float]:
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.runtime.errors import PeerFailure

    pipe = Pipeline(mlp_layer_factories(width=MLP_WIDTH, depth=6, seed=0), loss_fn=F.mse_loss, optimizer=sgd,
                    config=PipelineConfig(num_stages=ctx.world_size, num_microbatches=6, heartbeat_timeout=5.0),
                    context=ctx)
    x = torch.randn(12, MLP_WIDTH)
    for step in range(10_000):
        if step == kill_step and ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            pipe.train_step(x, x)
        except PeerFailure as failure:
            return str(failure), time.monotonic() - started
    return "no failure", 0.0


class Widen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(MLP_WIDTH, 2 * MLP_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def mismatched_job(ctx: Any) -> str:
    """Stage 0 outputs width 32; stage 1's first layer takes width 16."""
    from pipetrain.api.pipeline import Pipeline

    layers = [Widen, lambda: nn.Linear(MLP_WIDTH, MLP_WIDTH)]
    pipe = Pipeline(layers, loss_fn=F.mse_loss, optimizer=sgd,
                    config=PipelineConfig(num_stages=2, num_microbatches=2, heartbeat_timeout=5.0),
                    context=ctx)
    x = torch.randn(4, MLP_WIDTH)
    try:
        pipe.train_step(x, x)
    except Exception as error:
        notes = "\n".join(getattr(error, "__notes__", []))
        return f"{type(error).__name__}: {error}\n{notes}"
    return "no error"


def construction_error_job(ctx: Any, config: dict[str, Any], depth: int) -> str:
    from pipetrain.api.pipeline import Pipeline

    try:
        Pipeline(mlp_layer_factories(width=MLP_WIDTH, depth=depth, seed=0), loss_fn=F.mse_loss,
                 optimizer=sgd, config=PipelineConfig(**config), context=ctx)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def gpt_eval_job(ctx: Any, config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The untrained GPT's output (broadcast) and mean loss on a batch of 5 sequences."""
    pipe = make_gpt_pipeline(ctx, config)
    x, y = gpt_batches(1, batch=5)[0]
    output = pipe.eval_step(x, broadcast=True)
    loss = pipe.eval_step(x, y)
    pipe.close()
    return output, loss


def gpt_eval_reference() -> tuple[torch.Tensor, float]:
    model = build_gpt(GPT, seed=3)
    x, y = gpt_batches(1, batch=5)[0]
    with torch.no_grad():
        output = model(x)
    return output, float(gpt_loss(output, y))


def environment_job(context: Any, name: str) -> tuple[str | None, int]:
    """``os.environ[name]`` as this rank sees it, and its pid."""
    import os

    return os.environ.get(name), os.getpid()


def compiled_jobs(ctx: Any, config: dict[str, Any], steps: int, hf_config: dict[str, Any],
                  hf_steps: int) -> dict[str, Any]:
    """The GPT, then Hugging Face GPT-2 (captured), trained with ``compile=True`` in the
    same workers (inductor's start-up paid once); their weights, losses and the graphs
    torch.compile made for each on this rank. Reaching torch.compile's recompile limit (after
    which it runs eager without a word) fails the job."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from helpers.frontend_jobs import hf_parity_job

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    params, losses = gpt_job(ctx, [{**config, "compile": True}], steps)[0]
    graphs = int(counters["stats"]["unique_graphs"])
    hf = hf_parity_job(ctx, [{**hf_config, "compile": True}], hf_steps)[0]
    return {"gpt": (params, losses, graphs),
            "hf": (hf["state"], hf["losses"], int(counters["stats"]["unique_graphs"]) - graphs)}
