"""Models with random ops, deferred batch norm and skip connections, their single-process
reference, and the worker function that trains them as a ``Pipeline``.

The reference is plain PyTorch in one process: the layers of an ``nn.Sequential`` run in
order on each micro-batch, each layer's generators seeded as the pipeline seeds them
(:func:`pipetrain.runtime.rng.seeded_layers` keyed by (seed, step, layer, micro-batch of
the batch)), the micro-batch losses weighted by their share of the batch, one SGD step.
Nothing of the pipeline is in it: no cut, no transport, no checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig
from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.microbatch import batch_size, split_batch
from pipetrain.runtime.rng import mix_seed, seeded_layers
from pipetrain.skip import Namespace, pop, skippable, stash

WIDTH = 12
SEED = 11
TOLERANCE = 1e-5
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
CHECKPOINTS = ("never", "except_last", "always")
State = dict[str, torch.Tensor]


# -- layers -----------------------------------------------------------------------------
class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FunctionalDropout(nn.Module):
    """A custom layer calling ``F.dropout`` (no dropout module, no ``dropout`` attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.rate = 0.4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.proj(x)), self.rate, training=self.training)


class Noise(nn.Module):
    """A random op that is not dropout: Gaussian noise in training."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y + 0.1 * torch.randn_like(y) if self.training else y


def _dropout_block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3))


# the namespace objects differ from process to process (a fresh id in each)
NS = Namespace()


@skippable(stash=["hidden", "raw"])
class StashTwo(nn.Module):
    """Stashes its input (no gradient) and its hidden state (with a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Any:
        yield stash("raw", x)
        hidden = self.proj(x)
        yield stash("hidden", hidden)
        return torch.tanh(hidden)


@skippable(stash=["gate"])
class StashGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.proj(x)
        yield stash("gate", y)
        return F.dropout(y, 0.2, training=self.training)


# (every layer has a parameter: a Pipeline stage needs one for its optimizer)
@skippable(pop=["hidden"])
class AddHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((WIDTH,), 0.5))

    def forward(self, x: torch.Tensor) -> Any:
        return x + self.scale * (yield pop("hidden"))


@skippable(pop=["gate"])
class ApplyGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> Any:
        return x * torch.sigmoid(self.scale * (yield pop("gate")))


@skippable(pop=["raw"])
class AddRaw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Any:
        return self.proj(x) + (yield pop("raw"))


def _normed() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU())


def _seeded(build: Callable[[], nn.Module], index: int) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + index)
            return build()
    return factory


MODELS: dict[str, list[Callable[[], nn.Module]]] = {
    # 8 layers: dropout modules, F.dropout in a custom layer, noise
    "dropout": [Dense, FunctionalDropout, _dropout_block, Noise, Dense, FunctionalDropout,
                _dropout_block, lambda: nn.Linear(WIDTH, WIDTH)],
    # 8 layers: 'hidden' stashed at 0, popped at 4; 'raw' stashed at 0, popped at 7;
    # 'gate' (in a namespace) stashed at 2, popped at 6; batch norms at 1, 3, 5
    "skips": [StashTwo, _normed, lambda: StashGate().isolate(NS), _normed, AddHidden, _normed,
              lambda: ApplyGate().isolate(NS), AddRaw],
    # 'raw' is stashed at 0 and never popped
    "unmatched": [StashTwo, _normed, lambda: StashGate().isolate(NS), _normed, AddHidden,
                  _normed, lambda: ApplyGate().isolate(NS), lambda: nn.Linear(WIDTH, WIDTH)],
}


def factories(name: str) -> list[Callable[[], nn.Module]]:
    return [_seeded(build, i) for i, build in enumerate(MODELS[name])]


def batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` training batches, then one held-out batch."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(size, WIDTH, generator=g), torch.randn(size, WIDTH, generator=g))
            for _ in range(steps + 1)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- the single-process reference --------------------------------------------------------
@functools.lru_cache(maxsize=16)
def reference(name: str, steps: int, size: int, *, num_microbatches: int, replicas: int = 1,
              deferred_batch_norm: bool = False, seed: int = SEED) -> tuple[State, list[float], float]:
    """Train the model in one process on the micro-batches of the pipeline's split; the
    state, the losses and the loss in eval mode on the held-out batch (cached: do not
    modify the result)."""
    model = nn.Sequential(*(f() for f in factories(name)))
    if deferred_batch_norm:
        model = DeferredBatchNorm.convert_deferred_batch_norm(model, num_microbatches * replicas)
    opt = sgd(model.parameters())
    losses = []
    *training, (held_x, held_y) = batches(steps, size)
    for step, (x, y) in enumerate(training):
        opt.zero_grad()
        total = 0.0
        # the pipeline splits the whole batch into num_microbatches per replica of the
        # first stage, dealt round-robin; the keys are the micro-batches' indices
        count = num_microbatches * replicas
        pieces = list(zip(range(count), split_batch(x, count), split_batch(y, count)))
        for key, xb, yb in pieces:
            with seeded_layers(mix_seed(seed, step), key, torch.device("cpu")) as enter:
                value = xb
                for index, layer in enumerate(model):
                    enter(index)
                    value = layer(value)
            loss = F.mse_loss(value, yb) * (batch_size(xb) / size)
            loss.backward()
            total += float(loss.detach().double())
        opt.step()
        losses.append(total)
    state = {f"layers.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        held_out = float(F.mse_loss(model(held_x), held_y))
    return state, losses, held_out


# -- the pipeline --------------------------------------------------------------------------
def train_job(ctx: Any, name: str, configs: list[dict[str, Any]], steps: int,
              size: int) -> list[tuple[State, list[float], bool, float]]:
    """Train ``name`` under each configuration; per configuration: this rank's state (the
    parameters and buffers of its layers), the losses, whether torch's generator state
    was the same after the steps as before (the caller's state is restored), and the
    eval-mode loss on the held-out batch."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for config in configs:
        pipe = Pipeline(factories(name), loss_fn=F.mse_loss, optimizer=sgd,
                        config=PipelineConfig(seed=SEED, **config), context=ctx)
        torch.manual_seed(1234)
        before = torch.default_generator.get_state()
        *training, (held_x, held_y) = batches(steps, size)
        losses = [pipe.train_step(x, y) for x, y in training]
        kept = torch.equal(before, torch.default_generator.get_state())
        state = {k: v.detach().clone() for k, v in pipe.model.state_dict().items()}
        held_out = pipe.eval_step(held_x, held_y)
        results.append((state, losses, kept, held_out))
        pipe.close()
    return results


def unmatched_job(ctx: Any) -> str:
    """The error every rank raises for a stash that no layer pops."""
    from pipetrain.api.pipeline import Pipeline

    try:
        Pipeline(factories("unmatched"), loss_fn=F.mse_loss, optimizer=sgd,
                 config=PipelineConfig(num_stages=2, num_microbatches=2), context=ctx)
    except TypeError as error:
        return str(error)
    return "no error"


# -- checking ------------------------------------------------------------------------------
def every_schedule(num_stages: int, **options: Any) -> list[dict[str, Any]]:
    """One configuration per schedule and checkpoint mode (interleaved: 2 stages per rank)."""
    return [
        {"schedule": schedule, "num_stages": num_stages, "checkpoint": checkpoint,
         "stages_per_rank": 2 if schedule == "interleaved-1f1b" else 1, **options}
        for schedule in SCHEDULES for checkpoint in CHECKPOINTS
    ]


def compare(name: str, results: list[Any], configs: list[dict[str, Any]], *, steps: int,
            size: int) -> list[str]:
    """Every configuration of a :func:`train_job` whose losses, state (parameters and
    buffers) or eval loss differ from the reference, or whose ranks' generator state
    moved, described."""
    failures = []
    for c, config in enumerate(configs):
        expected, expected_losses, expected_held_out = reference(
            name, steps, size, num_microbatches=config["num_microbatches"],
            replicas=config.get("replicas", 1),
            deferred_batch_norm=config.get("deferred_batch_norm", False))
        merged: dict[str, Any] = {}
        for rank in results:
            merged.update(rank[c][0])
        if set(merged) != set(expected):
            failures.append(f"{config}: state keys differ: {sorted(set(merged) ^ set(expected))}")
            continue
        worst = max(float((merged[k].double() - expected[k].double()).abs().max()) for k in expected)
        losses = results[0][c][1]
        loss_error = max(abs(a - b) for a, b in zip(losses, expected_losses))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: max |state diff| {worst:.2e}, max |loss diff| {loss_error:.2e}")
        if any(abs(rank[c][3] - expected_held_out) > TOLERANCE for rank in results):
            failures.append(f"{config}: eval loss {results[0][c][3]} != {expected_held_out}")
        if not all(rank[c][2] for rank in results):
            failures.append(f"{config}: a rank's torch generator state changed")
        if any(rank[c][1] != losses for rank in results):
            failures.append(f"{config}: the ranks report different losses")
    return failures
