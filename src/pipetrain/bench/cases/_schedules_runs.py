"""Case ``schedules``' real runs: per-layer costs profiled, then every schedule timed on 2 ranks.

:func:`schedules_worker` runs on the 2 ranks of a gloo job (one thread each). Rank 0
profiles each model's layers on one micro-batch with the machine to itself
(:func:`pipetrain.plan.profile_model`, rank 1 waiting): forward, backward and its
input / weight halves, optimizer step, saved activation bytes. Both ranks then cut the
layers where :func:`~pipetrain.bench.cases._schedules_sim.stage_balance` says (the cut the
simulator is fed), build one ``Pipeline`` per (model, schedule)
(:class:`~pipetrain.bench.vs_torch.runners.PipetrainRunner`, which keeps every timed
step's recorded actions), take two steps with each (their losses) and time them
round-robin (:func:`~pipetrain.bench.vs_torch.session.time_runners`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pipetrain.bench.cases._schedules_sim import SCHEDULES, ModelCosts, stage_balance
from pipetrain.bench.vs_torch.runners import WORLD_SIZE, PipetrainRunner

__all__ = ["ModelSpec", "profile_costs", "schedules_worker"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model of the case and its micro-batch: ``kind`` ``"mlp"`` (``depth`` x
    [Linear(width, width) + GELU], MSE against a fixed target, SGD: memory-bound) or
    ``"gpt"`` (embedding, ``depth`` transformer blocks, head; untied; next-token
    cross-entropy, AdamW: compute-bound). ``depth`` counts the layers the schedules cut.

    Example:
        >>> spec = ModelSpec(name="GPT", kind="gpt", depth=6, width=16, heads=2, context=8,
        ...                  microbatch_size=2)
        >>> len(spec.factories()), spec.batch(3)[0].shape
        (6, torch.Size([6, 8]))
    """

    name: str
    kind: str
    depth: int
    width: int
    microbatch_size: int
    heads: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in ("mlp", "gpt"):
            problems.append(f"kind {self.kind!r} is not 'mlp' or 'gpt'")
        if self.kind == "gpt" and self.depth < 3:
            problems.append(f"a gpt needs depth >= 3 (embedding, blocks, head), got {self.depth}")
        if self.kind == "gpt" and self.width % self.heads:
            problems.append(f"width {self.width} is not a multiple of heads {self.heads}")
        if problems:
            raise ValueError(f"ModelSpec {self.name!r}: " + "; ".join(problems))

    def factories(self) -> list[Any]:
        """The layers' seeded factories (every process builds the same weights)."""
        from pipetrain.models import GPTConfig, gpt_layer_factories, mlp_layer_factories

        if self.kind == "mlp":
            return mlp_layer_factories(width=self.width, depth=self.depth, activation="gelu",
                                       seed=0)
        return gpt_layer_factories(GPTConfig(num_layers=self.depth - 2, width=self.width,
                                             num_heads=self.heads, context=self.context,
                                             tie_embeddings=False), seed=0)

    def loss(self, output: Any, target: Any) -> Any:
        """The loss of a micro-batch's output."""
        from torch.nn import functional

        from pipetrain.models import gpt_loss

        return gpt_loss(output, target) if self.kind == "gpt" else functional.mse_loss(output,
                                                                                         target)

    def optimizer(self, params: Any) -> Any:
        """SGD for the MLP, AdamW for the GPT."""
        import torch

        if self.kind == "mlp":
            return torch.optim.SGD(params, lr=0.01)
        return torch.optim.AdamW(params, lr=3e-4)

    def batch(self, num_microbatches: int) -> tuple[Any, Any]:
        """A fixed mini-batch of ``num_microbatches`` micro-batches: inputs and targets."""
        import torch

        rows = self.microbatch_size * num_microbatches
        generator = torch.Generator().manual_seed(0)
        if self.kind == "gpt":
            shape = (rows, self.context)
            return (torch.randint(0, 256, shape, generator=generator),
                    torch.randint(0, 256, shape, generator=generator))
        return (torch.randn(rows, self.width, generator=generator),
                torch.randn(rows, self.width, generator=generator))


def profile_costs(spec: ModelSpec, *, warmup: int, repetitions: int) -> ModelCosts:
    """Every layer's costs on one micro-batch, in this process (one thread).

    Example::

        costs = profile_costs(spec, warmup=1, repetitions=3)
    """
    from pipetrain.plan import profile_model

    x, y = spec.batch(1)
    profile = profile_model(spec.factories(), x, device="cpu", loss_fn=spec.loss, target=y,
                            optimizer="sgd" if spec.kind == "mlp" else "adamw", warmup=warmup,
                            repetitions=repetitions)
    layers = profile.layers
    return ModelCosts(
        forward=tuple(p.forward_s for p in layers),
        backward=tuple(p.backward_s for p in layers),
        backward_input=tuple(p.backward_s if p.backward_input_s is None else p.backward_input_s
                             for p in layers),
        backward_weight=tuple(p.backward_weight_s or 0.0 for p in layers),
        step=tuple(p.optimizer_step_s or 0.0 for p in layers),
        activation_bytes=tuple(p.saved_bytes for p in layers),
        workspace_bytes=tuple(p.backward_workspace_bytes or 0 for p in layers),
        input_workspace_bytes=tuple(p.backward_input_workspace_bytes or 0 for p in layers))


class _Runner(PipetrainRunner):
    """A Pipeline that steps on its own model's mini-batch (the timing loop passes none).

    ``nonfinite="ignore"`` for every schedule (the asynchronous ones allow nothing else):
    no schedule pays for a check of the gradients' norm."""

    def __init__(self, ctx: Any, spec: ModelSpec, schedule: str, *, microbatches: int,
                 balance: Sequence[int]) -> None:
        super().__init__(ctx, schedule, spec.factories(), microbatches=microbatches,
                         loss_fn=spec.loss, optimizer=spec.optimizer,
                         label=f"{spec.name} {schedule}", balance=list(balance),
                         nonfinite="ignore")
        self.inputs, self.targets = spec.batch(microbatches)

    def step(self, *_: Any) -> float:
        return self.pipe.train_step(self.inputs, self.targets)


def schedules_worker(ctx: Any, specs: list[ModelSpec], settings: dict[str, int]
                     ) -> dict[str, Any]:
    """On each of the 2 ranks: profile (rank 0 alone), build a Pipeline per (model,
    schedule) on the profile's cut, two first steps each, then time them round-robin.
    Rank 0 returns the profiles (as dicts), the cuts, the first losses, every rank's
    samples and records, and what each runner ran. ``settings``: ``microbatches``,
    ``reps``, ``warmup``, ``profile_warmup``, ``profile_repetitions``.

    Example::

        raw = run_job(schedules_worker, specs, settings, world_size=2)[0]
    """
    import torch.distributed as dist

    from pipetrain.bench.harness import gather_objects
    from pipetrain.bench.vs_torch.session import first_losses, time_runners
    from pipetrain.schedule import default_stages_per_rank

    if ctx.world_size != WORLD_SIZE:
        raise ValueError(f"schedules_worker runs on {WORLD_SIZE} ranks, got {ctx.world_size}")
    mine = ({spec.name: profile_costs(spec, warmup=settings["profile_warmup"],
                                      repetitions=settings["profile_repetitions"])
             for spec in specs} if ctx.rank == 0 else None)
    dist.barrier()
    profiles: dict[str, ModelCosts] = gather_objects(mine)[0]
    runners: list[Any] = []
    balances: dict[str, list[int]] = {}
    for spec in specs:
        for schedule in SCHEDULES:
            balance = stage_balance(profiles[spec.name],
                                    WORLD_SIZE * default_stages_per_rank(schedule))
            runner = _Runner(ctx, spec, schedule, microbatches=settings["microbatches"],
                             balance=balance)
            balances[runner.label] = balance
            runners.append(runner)
    failures: dict[str, str] = {}
    losses = first_losses(runners, lambda k: (), failures)
    gathered, info = time_runners(runners, lambda k: (), reps=settings["reps"],
                                  warmup=settings["warmup"],
                                  microbatches=settings["microbatches"])
    if ctx.rank != 0:
        return {}
    return {"profiles": {name: dataclasses.asdict(c) for name, c in profiles.items()},
            "balances": balances, "first_losses": losses, "failures": failures,
            "gathered": gathered, "runners": info}
