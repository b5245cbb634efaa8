"""GPipe Table 2's measurements: per-layer costs, simulated steps, and real K = 2 steps.

:func:`simulated_throughput` is the simulator's answer for K partitions and M
micro-batches (pure Python): the layers' measured costs at the micro-batch size are
balanced into K stages (:func:`pipetrain.partition.solve` on forward + re-materialized
forward + backward), and the ``gpipe`` schedule with its optimizer steps is simulated
with those per-stage costs (no communication cost, one core per stage).
:func:`throughput_worker` runs on the 2 ranks of a job: each profiles a model
(:func:`pipetrain.plan.profile_model`, one thread, one rank at a time), then both time ``Pipeline`` (schedule
``gpipe``, ``checkpoint="always"``, the profile's balance) at every M, the runners
interleaved (:func:`pipetrain.bench.harness.interleave`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F

from pipetrain.models import (
    GPTConfig,
    ResNetConfig,
    gpt_layer_factories,
    gpt_loss,
    resnet_layer_factories,
)
from pipetrain.partition import solve
from pipetrain.schedule import Costs, build_schedule, simulate

__all__ = ["LayerCosts", "ModelSpec", "simulated_throughput", "throughput_worker"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """Seconds per layer at one micro-batch size: forward, backward, optimizer step.

    Example:
        >>> LayerCosts(forward=(1.0, 2.0), backward=(2.0, 4.0), step=(0.0, 0.0)).forward
        (1.0, 2.0)
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    step: tuple[float, ...]


def simulated_throughput(costs: LayerCosts, *, num_stages: int, num_microbatches: int,
                         batch: int) -> dict[str, Any]:
    """Samples per second of a GPipe step of ``batch`` samples in ``num_microbatches``
    micro-batches over ``num_stages`` stages, re-materializing (a backward also runs the
    forward again), as the simulator plays it; the balance and makespan with it.

    Example:
        >>> uniform = LayerCosts(forward=(1.0,) * 8, backward=(2.0,) * 8, step=(0.0,) * 8)
        >>> result = simulated_throughput(uniform, num_stages=4, num_microbatches=4, batch=8)
        >>> result["balance"], result["makespan"]
        ([2, 2, 2, 2], 56.0)
    """
    compute = [f + f + b for f, b in zip(costs.forward, costs.backward)]
    balance = solve(compute, num_stages)
    bounds = [sum(balance[:j]) for j in range(num_stages + 1)]

    def per_stage(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(sum(values[bounds[j]:bounds[j + 1]]) for j in range(num_stages))

    forward = per_stage(costs.forward)
    backward = tuple(b + f for b, f in zip(per_stage(costs.backward), forward))
    schedule = build_schedule("gpipe", num_ranks=num_stages, num_microbatches=num_microbatches,
                              optimizer_step=True)
    result = simulate(schedule, Costs(forward=forward, backward=backward,
                                      step=per_stage(costs.step)))
    return {"balance": balance, "makespan": result.makespan,
            "throughput": batch / result.makespan, "bubble": result.bubble_fraction}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model of Table 2 and its batch: ``kind`` ``"gpt"`` (``size``: blocks, width,
    heads, context) or ``"resnet"`` (``size``: blocks per stage, widths..., image side).

    Example:
        >>> spec = ModelSpec(name="ResNet", kind="resnet", size=(1, 4, 8, 8), batch=2)
        >>> len(spec.factories()), spec.tensors()[0].shape
        (5, torch.Size([2, 3, 8, 8]))
    """

    name: str
    kind: str
    size: tuple[int, ...]
    batch: int

    def factories(self) -> list[Any]:
        if self.kind == "gpt":
            depth, width, heads, context = self.size
            return gpt_layer_factories(GPTConfig(num_layers=depth, width=width, num_heads=heads,
                                                 context=context), seed=0)
        blocks, *widths, _ = self.size
        return resnet_layer_factories(ResNetConfig(widths=tuple(widths), num_blocks=blocks),
                                      seed=0)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return gpt_loss(output, target) if self.kind == "gpt" else F.cross_entropy(output, target)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        if self.kind == "gpt":
            shape = (self.batch, self.size[3])
            return (torch.randint(0, 256, shape, generator=generator),
                    torch.randint(0, 256, shape, generator=generator))
        side = self.size[-1]
        return (torch.randn(self.batch, 3, side, side, generator=generator),
                torch.randint(0, 10, (self.batch,), generator=generator))


def _profile(spec: ModelSpec, microbatches: Sequence[int], *, warmup: int,
             repetitions: int, rounds: int) -> dict[int, LayerCosts]:
    """Each layer's costs at each micro-batch size: the least, per layer and cost, over
    ``rounds`` rounds that go over the sizes in turn (a busy spell of a shared machine
    only adds time, and would otherwise hit one size and skew the sizes' ratios)."""
    from pipetrain.plan.profiler import profile_model

    x, y = spec.tensors()
    seen: dict[int, list[LayerCosts]] = {m: [] for m in microbatches}
    for r in range(rounds):
        for m in [*microbatches[r % len(microbatches):], *microbatches[:r % len(microbatches)]]:
            profile = profile_model(spec.factories(), x, batch_size=spec.batch // m,
                                    device="cpu", loss_fn=spec.loss, target=y, warmup=warmup,
                                    repetitions=repetitions, optimizer="adamw")
            seen[m].append(LayerCosts(
                forward=tuple(p.forward_s for p in profile.layers),
                backward=tuple(p.backward_s for p in profile.layers),
                step=tuple(p.optimizer_step_s or 0.0 for p in profile.layers)))
    return {m: LayerCosts(**{name: tuple(min(layer) for layer in zip(
                                 *(getattr(c, name) for c in costs)))
                             for name in ("forward", "backward", "step")})
            for m, costs in seen.items()}


class _Runner:
    """One Pipeline of Table 2's real runs, stepping on its own batch."""

    def __init__(self, spec: ModelSpec, m: int, balance: list[int], context: Any) -> None:
        import pipetrain

        self.label = f"{spec.name} M={m}"
        self.x, self.y = spec.tensors()
        self.pipe = pipetrain.Pipeline(
            spec.factories(), loss_fn=spec.loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
            config=pipetrain.PipelineConfig(schedule="gpipe", num_stages=context.world_size,
                                            num_microbatches=m, checkpoint="always",
                                            balance=balance),
            context=context)

    def step(self) -> None:
        self.pipe.train_step(self.x, self.y)


def throughput_worker(context: Any, specs: list[ModelSpec], microbatches: list[int],
                      settings: dict[str, int]) -> dict[str, Any]:
    """On every rank of a K-rank job: profile the models (rank ``r`` the ``r``-th, one
    rank after the other, so that a profile has the machine to itself), then time each
    model at each M as a K-stage Pipeline, interleaved; rank 0's answer holds the
    profiles and every runner's step times (max over the ranks).
    ``settings``: ``reps``, ``warmup`` (of the timing), ``profile_warmup``,
    ``profile_repetitions`` and ``profile_rounds``.

    Example::

        answer = run_job(throughput_worker, specs, [1, 4, 32], settings, world_size=2)[0]
    """
    import torch.distributed as dist

    from pipetrain.bench.harness import gather_objects, interleave, step_times

    mine: dict[str, dict[int, LayerCosts]] = {}
    for rank in range(context.world_size):  # one process at a time: no contention
        if rank == context.rank:
            mine = {spec.name: _profile(spec, microbatches, warmup=settings["profile_warmup"],
                                        repetitions=settings["profile_repetitions"],
                                        rounds=settings["profile_rounds"])
                    for k, spec in enumerate(specs) if k % context.world_size == rank}
        dist.barrier()
    profiles: dict[str, dict[int, LayerCosts]] = {}
    for part in gather_objects(mine):
        profiles.update(part)
    runners = []
    balances = {}
    for spec in specs:
        for m in microbatches:
            costs = profiles[spec.name][m]
            balance = solve([2 * f + b for f, b in zip(costs.forward, costs.backward)],
                            context.world_size)
            balances[f"{spec.name} M={m}"] = balance
            runners.append(_Runner(spec, m, balance, context))
    samples, window = interleave(runners, lambda k: (), reps=settings["reps"],
                                 warmup=settings["warmup"], rotate=True)
    every = gather_objects(samples)
    for runner in runners:
        runner.pipe.close()
    times = {r.label: step_times(every, r.label) for r in runners}
    return {"profiles": {name: {m: dataclasses.asdict(c) for m, c in by_m.items()}
                         for name, by_m in profiles.items()},
            "balances": balances, "step_times": times, "cpu_window": repr(window)}
