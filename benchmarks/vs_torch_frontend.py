"""pipetrain's frontend vs torch.distributed.pipelining's ``pipeline()`` on the same HF GPT-2.

Both take the same unmodified Hugging Face ``GPT2LMHeadModel`` (tied token embedding and
output head; dropout off; byte vocabulary 256), capture it with torch.export and cut it
at the same block (``transformer.h.<layers/2>``) into 2 stages on 2 processes (gloo on
127.0.0.1, 1 intra-op thread each), and train it with the same 1F1B schedule, the same
micro-batches, MSE-free cross-entropy on shifted tokens and SGD. Reported:

* the median time of a training step (forward, backward, optimizer step; the max over
  the ranks, each step after a barrier) and the throughput ratio pipetrain / torch; the
  runners alternate, repetition by repetition, in the same two processes;
* the tied-weight gap after the run: the largest difference between the token
  embedding held by stage 0 and the output head held by stage 1. torch's ``pipeline()``
  gives each stage its own copy and nothing sums their gradients, so the copies drift
  apart; pipetrain finds the tie and sums the gradients, so its copies stay equal (0);
* the loss of the first step of each (both equal single-process training there, before
  the copies can differ).

Figures measured on a shared, loaded machine are "under load": compare ratios only.

Usage::

    python benchmarks/vs_torch_frontend.py [--layers 4 --width 128 --seq 64 --batch 16
                                            --microbatches 4 --reps 10 --json]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from pipetrain.bench.harness import (
    dump_json,
    foreign_load,
    gather_objects,
    interleave,
    load_line,
    median,
    run_job,
    step_times,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=max(2 * args.seq, 300), n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))


def _batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _pipetrain(args: argparse.Namespace, ctx: Any, split: str) -> tuple[Any, Any]:
    from pipetrain import Pipeline, PipelineConfig

    x, _ = _batch(args, 0)
    pipe = Pipeline(_model(args), example_inputs=(x,), split_points=[split], loss_fn=_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=args.lr),
                    config=PipelineConfig(schedule="1f1b", num_stages=2,
                                          num_microbatches=args.microbatches,
                                          fuse_weight_gradients=args.fuse), context=ctx)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return pipe.train_step(x, y)

    def tied() -> torch.Tensor:
        state = pipe.state_dict()
        name = "transformer.wte.weight" if dist.get_rank() == 0 else "lm_head.weight"
        return state[name].detach().clone()

    return step, tied


def _torch(args: argparse.Namespace, split: str) -> tuple[Any, Any]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    rank = dist.get_rank()
    x, _ = _batch(args, 0)
    micro = x[: args.batch // args.microbatches]
    pipe = pipeline(_model(args), mb_args=(micro,), mb_kwargs={"use_cache": False},
                    split_spec={split: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=_loss)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([float(sum(losses) / len(losses)) if losses else 0.0])
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


def worker(ctx: Any, args: argparse.Namespace) -> dict[str, Any]:
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
            "first_loss": {r.label: r.first_loss for r in runners},
            "tied_gap": {n: _gap(r[1]) for n, r in built.items()},
            "steps": args.warmup + args.reps, "torch_error": torch_error,
            "load_during_timing": foreign_load([g["window"] for g in gathered])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="pipetrain: leave weight gradients to autograd")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    result = run_job(worker, args, timeout=1800)[0]
    result["args"] = vars(args)
    times = result["median_s"]
    if "torch" in times:
        result["throughput_ratio"] = times["torch"] / times["pipetrain"]
    if args.json:
        print(dump_json(result))
        return
    print(f"HF GPT-2, {args.layers} blocks x {args.width}, batch {args.batch} x {args.seq} tokens, "
          f"{args.microbatches} micro-batches, 2 stages (medians of {args.reps} interleaved "
          "repetitions)")
    print(load_line(result["load_during_timing"]))
    for name, seconds in times.items():
        print(f"  {name:9s} step {seconds * 1e3:8.1f} ms  first loss {result['first_loss'][name]:.5f}"
              f"  tied-weight gap after {result['steps']} steps {result['tied_gap'][name]:.3g}")
    if "throughput_ratio" in result:
        print(f"  throughput pipetrain / torch: {result['throughput_ratio']:.2f}x")
    else:
        print(f"  torch: not comparable ({result['torch_error']})")


if __name__ == "__main__":
    main()
