"""Case ``vs_torch_frontend``: pipetrain's frontend vs torch.distributed.pipelining's ``pipeline()`` on the same HF GPT-2.

Both take the same unmodified Hugging Face ``GPT2LMHeadModel`` (tied token embedding and
output head; dropout off; byte vocabulary 256), capture it with torch.export and cut it
at the same block (``transformer.h.<layers/2>``) into 2 stages on 2 processes (gloo on
127.0.0.1, 1 intra-op thread each), and train it with the same 1F1B schedule, the same
micro-batches, cross-entropy on shifted tokens and SGD. Reported:

* the median time of a training step (forward, backward, optimizer step; the max over
  the ranks, each step after a barrier) and the throughput ratio pipetrain / torch (goal:
  at least 1); the runners alternate, repetition by repetition, in the same two
  processes; torch runs at its fastest settings (``scale_grads=False`` with the loss
  divided by the micro-batches, gradients kept between steps), pipetrain at its defaults;
* the tied-weight gap after the run: the largest difference between the token
  embedding held by stage 0 and the output head held by stage 1. torch's ``pipeline()``
  gives each stage its own copy and nothing sums their gradients, so the copies drift
  apart; pipetrain finds the tie and sums the gradients, so its copies stay equal (0);
* the loss of the first step of each (both equal single-process training there, before
  the copies can differ).

Full size: 4 blocks of width 128, batch 16 x 64 tokens, 4 micro-batches, 10 timed
repetitions; ``--quick``: 2 blocks of width 64, 4 repetitions.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.drawings import bars, find_table
from pipetrain.bench.harness import (
    foreign_load,
    gather_objects,
    interleave,
    load_line,
    median,
    run_job,
    spread_warnings,
    step_times,
)
from pipetrain.bench.vs_torch.runners import TORCH_SETTINGS, per_microbatch

__all__ = ["CASE", "Options", "draw", "run", "worker"]


@dataclass(frozen=True, kw_only=True)
class Options:
    """The GPT-2's shape, the batch, the optimizer and the repetitions."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    seq: int = 64
    batch: int = 16
    microbatches: int = 4
    lr: float = 0.5
    warmup: int = 2
    reps: int = 10
    fuse: bool = True
    """pipetrain's fused weight gradients (``False``: left to autograd)."""


FULL = Options()
QUICK = replace(FULL, layers=2, width=64, warmup=1, reps=4)


def _model(args: Options) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model: torch.nn.Module = GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=max(2 * args.seq, 300), n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))
    return model


def _batch(args: Options, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _pipetrain(args: Options, ctx: Any, split: str) -> tuple[Any, Any]:
    from pipetrain import Pipeline, PipelineConfig

    x, _ = _batch(args, 0)
    pipe = Pipeline(_model(args), example_inputs=(x,), split_points=[split], loss_fn=_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=args.lr),
                    config=PipelineConfig(schedule="1f1b", num_stages=2,
                                          num_microbatches=args.microbatches,
                                          fuse_weight_gradients=args.fuse), context=ctx)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(pipe.train_step(x, y))

    def tied() -> torch.Tensor:
        state = pipe.state_dict()
        name = "transformer.wte.weight" if dist.get_rank() == 0 else "lm_head.weight"
        weight: torch.Tensor = state[name]
        return weight.detach().clone()

    return step, tied


def _torch(args: Options, split: str) -> tuple[Any, Any]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    rank = dist.get_rank()
    x, _ = _batch(args, 0)
    micro = x[: args.batch // args.microbatches]
    pipe = pipeline(_model(args), mb_args=(micro,), mb_kwargs={"use_cache": False},
                    split_spec={split: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    # its fastest settings (TORCH_SETTINGS): the loss divided by the micro-batches instead
    # of a pass over every gradient after the backward, gradients kept between steps
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches,
                            loss_fn=per_microbatch(_loss, args.microbatches), scale_grads=False)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        value = torch.tensor([float(sum(v.detach() for v in losses)) if losses else 0.0])
        dist.broadcast(value, src=1)
        return float(value)

    def tied() -> torch.Tensor:
        named = dict(stage.submod.named_parameters())
        key = next(k for k in named if ("wte" in k if rank == 0 else "lm_head" in k))
        return named[key].detach().clone()

    return step, tied


class _Runner:
    """One framework's training step for the harness; keeps its first loss."""

    def __init__(self, label: str, step: Any) -> None:
        self.label = label
        self._step = step
        self.first_loss: float | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self._step(x, y)
        if self.first_loss is None:
            self.first_loss = loss


def _gap(tied: Any) -> float:
    mine = tied()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    return float((both[0] - both[1]).abs().max())


def worker(ctx: Any, args: Options) -> dict[str, Any]:
    """Every rank: both frameworks built, timed alternately; the figures (every rank)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # this spawned rank's own environment
    torch.set_num_threads(1)
    split = f"transformer.h.{args.layers // 2}"
    built = {"pipetrain": _pipetrain(args, ctx, split)}
    try:
        built["torch"] = _torch(args, split)
        torch_error = None
    except Exception as error:  # reported, not hidden
        torch_error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    runners = [_Runner(name, step) for name, (step, _) in built.items()]
    samples, window = interleave(runners, lambda k: _batch(args, k), reps=args.reps,
                                 warmup=args.warmup)
    gathered = gather_objects({"samples": samples, "window": window})
    per_rank = [g["samples"] for g in gathered]
    return {"median_s": {r.label: median(step_times(per_rank, r.label)) for r in runners},
            "step_s": {r.label: step_times(per_rank, r.label) for r in runners},
            "first_loss": {r.label: r.first_loss for r in runners},
            "tied_gap": {n: _gap(r[1]) for n, r in built.items()},
            "steps": args.warmup + args.reps, "torch_error": torch_error,
            "load_during_timing": foreign_load([g["window"] for g in gathered])}


def run(context: BenchContext) -> BenchResult:
    """Both frameworks on the same GPT-2 in one 2-rank job; the table of their figures."""
    args = QUICK if context.quick else FULL
    context.progress(f"HF GPT-2 {args.layers} blocks x {args.width}, 2 stages, "
                     f"{args.reps} interleaved repetitions")
    result: dict[str, Any] = run_job(worker, args, timeout=1800)[0]
    result["options"] = asdict(args)
    times = result["median_s"]
    if "torch" in times:
        result["throughput_ratio"] = times["torch"] / times["pipetrain"]
    rows = [[name, round(seconds * 1e3, 1),
             round(times["torch"] / seconds, 2) if "torch" in times else None,
             round(result["first_loss"][name], 5), f"{result['tied_gap'][name]:.3g}"]
            for name, seconds in times.items()]
    notes = (f"{load_line(result['load_during_timing'])}. The tied-weight gap is the largest "
             f"difference between stage 0's token embedding and stage 1's output head after "
             f"{result['steps']} steps: torch's pipeline() gives each stage its own copy and "
             "nothing sums their gradients; pipetrain sums them.")
    if result["torch_error"]:
        notes += f" torch: not comparable ({result['torch_error']})."
    table = Table(
        title=f"Frontend: HF GPT-2 ({args.layers} blocks x {args.width}, batch {args.batch} x "
              f"{args.seq} tokens, {args.microbatches} micro-batches), 2 stages, 1F1B, SGD",
        columns=["framework", "median step ms", "throughput / torch", "first loss",
                 "tied-weight gap"],
        rows=rows,
        anchor="torch.distributed.pipelining's pipeline() + Schedule1F1B on the same model, "
               "cut at the same block, interleaved in the same 2 processes (gloo, 1 thread "
               f"each). Settings: pipetrain at its defaults; torch: {TORCH_SETTINGS}",
        notes=notes, key="frontend",
        goals=[Goal.at_least("pipetrain / torch throughput", result.get("throughput_ratio"),
                             1.0, unit="x")])
    return BenchResult(tables=[table], data=result,
                       warnings=spread_warnings(result["step_s"]))


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """The median training step of pipetrain's frontend and of torch's pipeline(): one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['vs_torch_frontend_step.png']
    """
    return bars(out / "vs_torch_frontend_step.png", find_table(tables, "frontend"),
                "framework", {"median step": "median step ms"},
                title="HF GPT-2 on 2 stages, 1F1B: median training step", ylabel="ms")


CASE = Case(name="vs_torch_frontend",
            title="Any nn.Module: Pipeline(model) vs torch's pipeline() on HF GPT-2",
            run=run, draw=draw, quick_seconds=10, full_seconds=20, needs=("transformers",))
