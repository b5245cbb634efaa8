"""The runners of ``vs_torch_fsdp``: a GPT over a (pp, dp) mesh, FSDP2 on the dp ranks.

Two ways to train the same GPT on ``P x D`` processes with each stage sharded over its
``D`` data-parallel ranks by ``fully_shard``:

- :class:`PipetrainRunner`: :class:`pipetrain.Pipeline` with ``data_parallel="fsdp"``
  (and, for the ``lean`` variant, ``reshard_after_forward`` and
  ``reduce_each_microbatch``);
- :class:`TorchRunner`: torchtitan's recipe on ``torch.distributed.pipelining``: each
  rank builds its stage's layers as one ``nn.Sequential``, ``fully_shard`` on every layer
  with parameters and on the stage (``reshard_after_forward=False``, as torchtitan sets it
  under pipeline parallelism: the parameters stay gathered across a step's
  micro-batches), a ``PipelineStage`` on the mesh's pp group, torch's schedule class
  (which reduce-scatters the gradients after the last micro-batch's backward), AdamW on
  the stage's sharded parameters. At its fastest settings: ``scale_grads=False`` with the
  loss divided by the micro-batch count instead, gradients kept between steps
  (``zero_grad(set_to_none=False)``).

Both take the global batch; the torch runner gives each dp rank its contiguous share,
pipetrain deals the micro-batches round-robin over its replicas. Both compute the mean
loss over the global batch, so their losses agree to rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipetrain.bench.harness import PeakMemory, gather_objects, interleave

__all__ = ["LIBRARIES", "TORCH_CLASSES", "PipetrainRunner", "Sizes", "TorchRunner",
           "memory_worker", "timing_worker"]

TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
"""pipetrain's schedule -> torch's class for it (the schedules compared)."""
LIBRARIES = ("pipetrain", "pipetrain-lean", "torch")
"""The runners: pipetrain at the anchor's policy, pipetrain with every FSDP saving on,
torch's recipe."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The GPT, the batch and the mesh of a run.

    Example:
        >>> Sizes(blocks=4, width=64, heads=2, seq=32, batch=8, microbatches=2, reps=2,
        ...       stages=2, replicas=2).cut()
        [3, 3]
    """

    blocks: int
    width: int
    heads: int
    seq: int
    batch: int
    """Sequences per step, all replicas together."""
    microbatches: int
    """Micro-batches per replica and step."""
    reps: int
    stages: int = 2
    replicas: int = 2

    def config(self) -> Any:
        from pipetrain.models import GPTConfig

        return GPTConfig(num_layers=self.blocks, width=self.width, num_heads=self.heads,
                         context=self.seq, tie_embeddings=False)

    def cut(self) -> list[int]:
        """Layers per stage (embedding + blocks + head), blocks split evenly."""
        per, extra = divmod(self.blocks, self.stages)
        counts = [per + (s < extra) for s in range(self.stages)]
        counts[0] += 1
        counts[-1] += 1
        return counts

    def batches(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(k)
        shape = (self.batch, self.seq)
        return (torch.randint(0, 256, shape, generator=generator),
                torch.randint(0, 256, shape, generator=generator))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _mesh(sizes: Sizes) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (sizes.stages, sizes.replicas, 1),
                            mesh_dim_names=("pp", "dp", "tp"))


class PipetrainRunner:
    """pipetrain's Pipeline on the mesh; ``lean``: parameters resharded after each forward
    and gradients reduce-scattered after each backward."""

    def __init__(self, ctx: Any, sizes: Sizes, schedule: str, mesh: Any, *, lean: bool) -> None:
        import pipetrain
        from pipetrain.models import gpt_layer_factories, gpt_loss

        self.label = f"{'pipetrain-lean' if lean else 'pipetrain'} {schedule}"
        self.pipe = pipetrain.Pipeline(
            gpt_layer_factories(sizes.config(), seed=0), loss_fn=gpt_loss, optimizer=_adamw,
            config=pipetrain.PipelineConfig(
                schedule=schedule, num_stages=sizes.stages, replicas=sizes.replicas,
                data_parallel="fsdp", num_microbatches=sizes.microbatches,
                balance=sizes.cut(), reshard_after_forward=lean, reduce_each_microbatch=lean),
            context=ctx, mesh=mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.pipe.train_step(x, y))

    def close(self) -> None:
        self.pipe.close()


class TorchRunner:
    """torchtitan's recipe: a PipelineStage of ``fully_shard``-ed layers per rank."""

    def __init__(self, sizes: Sizes, schedule: str, mesh: Any) -> None:
        from torch import nn
        from torch.distributed import pipelining
        from torch.distributed.fsdp import fully_shard

        from pipetrain.models import gpt_layer_factories, gpt_loss

        self.label = f"torch {schedule}"
        self.pp, self.dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        self.replicas, microbatches = sizes.replicas, sizes.microbatches
        factories = gpt_layer_factories(sizes.config(), seed=0)
        first = sum(sizes.cut()[:self.pp])
        layers = [factories[i]() for i in range(first, first + sizes.cut()[self.pp])]
        module = nn.Sequential(*layers)
        for layer in layers:
            if next(layer.parameters(), None) is not None:
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        stage = pipelining.PipelineStage(module, self.pp, sizes.stages, torch.device("cpu"),
                                         group=mesh["pp"].get_group())

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return gpt_loss(output, target) / microbatches

        cls = getattr(pipelining, TORCH_CLASSES[schedule])
        self.schedule = cls(stage, microbatches, loss_fn=loss_fn, scale_grads=False)
        self.optimizer = _adamw(module.parameters())
        self.last = self.pp == sizes.stages - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        share = x.shape[0] // self.replicas
        part = slice(self.dp * share, (self.dp + 1) * share)
        losses: list[torch.Tensor] = []
        if self.pp == 0:
            self.schedule.step(x[part])
        else:
            self.schedule.step(target=y[part] if self.last else None, losses=losses)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return float(sum(loss.item() for loss in losses)) if self.last else None

    def close(self) -> None:
        pass


def _runner(ctx: Any, sizes: Sizes, library: str, schedule: str, mesh: Any) -> Any:
    if library == "torch":
        return TorchRunner(sizes, schedule, mesh)
    return PipetrainRunner(ctx, sizes, schedule, mesh, lean=library == "pipetrain-lean")


def _global_loss(values: list[Any]) -> float:
    """A step's loss over the global batch from every rank's: pipetrain's ranks all give
    it; torch's last-stage ranks give their replica's, whose mean it is."""
    given = [float(v) for v in values if v is not None]
    return sum(given) / len(given)


def timing_worker(ctx: Any, sizes: Sizes, schedules: list[str]) -> dict[str, Any]:
    """Every rank: build every runner, take each one's first two losses (same weights and
    batches), then time them interleaved; this rank's samples and CPU window."""
    mesh = _mesh(sizes)
    runners = [_runner(ctx, sizes, library, schedule, mesh)
               for schedule in schedules for library in LIBRARIES]
    losses: dict[str, list[float]] = {}
    for runner in runners:
        values = [runner.step(*sizes.batches(k)) for k in range(2)]
        every = gather_objects(values)
        losses[runner.label] = [_global_loss([r[k] for r in every]) for k in range(2)]
    samples, window = interleave(runners, sizes.batches, reps=sizes.reps, warmup=1, rotate=True)
    for runner in runners:
        runner.close()
    return {"samples": samples, "cpu_window": window, "losses": losses}


def memory_worker(ctx: Any, sizes: Sizes, library: str, schedule: str) -> float:
    """Every rank: this rank's peak resident growth (MiB) over 3 steps of one runner,
    from after it was built."""
    runner = _runner(ctx, sizes, library, schedule, _mesh(sizes))
    meter = PeakMemory([torch.device("cpu")])
    meter.start()
    for k in range(3):
        runner.step(*sizes.batches(k))
    peak = meter.peak_mib()
    runner.close()
    return round(peak, 1)
