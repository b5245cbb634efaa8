"""Asynchronous schedules vs synchronous 1F1B on the default language-model task.

What it measures
----------------
The model and data of ``pipetrain train`` (a byte-level GPT: 4 blocks, width 64, 4 heads,
context 128; the Python standard library's source; batches of 32 sequences drawn by step;
AdamW, betas (0.9, 0.95), weight decay 0.1; linear warm-up then a cosine to 0.1 of the
peak), trained three ways in the same processes (``--stages`` ranks, gloo, 1 thread
each), from the same weights on the same batches:

- ``1f1b``: synchronous, as ``pipetrain train`` runs it (tied embeddings, gradient
  clipping at 1.0);
- ``pipedream`` and ``2bw``: asynchronous (no flush; one update per micro-batch, resp.
  per step with a one-step delay). They train the GPT with untied embeddings and without
  clipping, as ``pipetrain train --schedule pipedream|2bw`` does. PipeDream applies
  ``M`` updates per step, with the same learning rate by default (``--pipedream-lr-scale``
  multiplies it; ``1 / M`` makes each update the size of a step's share of one).

The three runners take their steps in turn (interleaved: step ``t`` of every runner runs
before step ``t + 1`` of any), so the machine's load falls on all alike. Each step is
timed on every rank (``perf_counter`` around ``train_step``, after a barrier); a step's
time is the slowest rank's. Reported per runner: the median step time after
``--skip`` warm-up steps and the throughput ratio to 1F1B's (above 1: faster); the mean
training loss of the last tenth of the steps; and the validation loss (the same
``--val-batches`` validation batches for all, after a drain) with its ratio to 1F1B's.
The acceptance asks for a validation loss within 5% of 1F1B's and a throughput above it.

Run it
------
::

    PYTHONPATH=src python benchmarks/async_convergence.py                 # 300 steps, 2 stages
    PYTHONPATH=src python benchmarks/async_convergence.py --steps 20 --json
    PYTHONPATH=src python benchmarks/async_convergence.py --stages 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

RUNNERS = ("1f1b", "pipedream", "2bw")


def _lr_factor(warmup: int, total: int) -> Any:
    from pipetrain.cli.train_job import lr_factor

    return lr_factor(warmup, total)


def _pipeline(ctx: Any, name: str, options: dict[str, Any]) -> Any:
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss, gpt_ties

    asynchronous = name != "1f1b"
    model = GPTConfig(context=128, num_layers=4, width=64, num_heads=4, dropout=0.0,
                      tie_embeddings=not asynchronous)
    lr = options["lr"] * options["lr_scale"].get(name, 1.0)
    config = PipelineConfig(schedule=name, num_stages=options["stages"],
                            num_microbatches=options["microbatches"],
                            clip_grad_norm=None if asynchronous else options["clip"],
                            nonfinite="ignore" if asynchronous else "error", seed=0)
    return Pipeline(
        gpt_layer_factories(model, seed=0), loss_fn=gpt_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), fused=True,
                                                   weight_decay=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, _lr_factor(options["warmup"], options["steps"])),
        ties=gpt_ties(model), config=config, context=ctx)


def job(ctx: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Every runner, interleaved step by step (in each rank)."""
    from pipetrain.data import TextDataset, load_corpus

    dataset = TextDataset(load_corpus(None), context=128, seed=0)
    pipes = {name: _pipeline(ctx, name, options) for name in options["runners"]}
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(options["steps"]):
        inputs, targets = dataset.batch(step, options["batch_size"])
        for name, pipe in pipes.items():
            dist.barrier()
            began = time.perf_counter()
            losses[name].append(pipe.train_step(inputs, targets))
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds[name].append(float(elapsed))
    val: dict[str, float] = {}
    for name, pipe in pipes.items():
        pipe.drain()
        batches = [dataset.batch(k, options["batch_size"], split="val")
                   for k in range(options["val_batches"])]
        val[name] = statistics.fmean(pipe.eval_step(x, y) for x, y in batches)
        pipe.close()
    return {"seconds": seconds, "losses": losses, "val": val}


def summarize(result: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    skip, steps = options["skip"], options["steps"]
    tail = max(1, steps // 10)
    rows = {}
    for name in options["runners"]:
        timed = result["seconds"][name][skip:] or result["seconds"][name]
        rows[name] = {"median_step_seconds": statistics.median(timed),
                      "train_loss_last_tenth": statistics.fmean(result["losses"][name][-tail:]),
                      "val_loss": result["val"][name]}
    anchor = rows.get("1f1b")
    for row in rows.values():
        if anchor is not None:
            row["throughput_vs_1f1b"] = anchor["median_step_seconds"] / row["median_step_seconds"]
            row["val_loss_vs_1f1b"] = row["val_loss"] / anchor["val_loss"]
    samples = steps * options["batch_size"]
    return {"options": options, "samples": samples, "runners": rows, "losses": result["losses"]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up steps (default 50)")
    parser.add_argument("--pipedream-lr-scale", type=float, default=1.0,
                        help="PipeDream's peak LR = --lr times this (default 1)")
    parser.add_argument("--two-bw-lr-scale", type=float, default=1.0,
                        help="2BW's peak LR = --lr times this (default 1)")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="1F1B's gradient clipping, as pipetrain train's --clip (default 1; 0 = off)")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the timing (default 5)")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches (default 8)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=7200.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from pipetrain.bench.harness import dump_json, run_job

    args = parse_args(argv)
    options = {
        "steps": args.steps, "stages": args.stages, "microbatches": args.microbatches,
        "batch_size": args.batch_size, "lr": args.lr, "warmup": min(args.warmup, args.steps),
        "lr_scale": {"pipedream": args.pipedream_lr_scale, "2bw": args.two_bw_lr_scale},
        "clip": args.clip if args.clip > 0 else None,
        "skip": min(args.skip, max(args.steps - 1, 0)), "val_batches": args.val_batches,
        "runners": [r for r in args.runners.split(",") if r],
    }
    result = run_job(job, options, world_size=args.stages, timeout=args.timeout)[0]
    summary = summarize(result, options)
    if args.json:
        sys.stdout.write(dump_json(summary) + "\n")
        return 0
    print(f"default LM task, {args.stages} stages x 1 thread, {args.steps} steps of "
          f"{args.batch_size} sequences ({summary['samples']} samples), M = {args.microbatches}; "
          f"peak LR {args.lr:g} (PipeDream x {options['lr_scale']['pipedream']:g}, 2BW x "
          f"{args.two_bw_lr_scale:g}), 1F1B clip {options['clip']}; measured under load: ratios only")
    print(f"{'schedule':<10} {'step (s)':>9} {'throughput':>11} {'train loss':>11} {'val loss':>9} {'val / 1f1b':>11}")
    for name, row in summary["runners"].items():
        ratio = row.get("throughput_vs_1f1b", math.nan)
        print(f"{name:<10} {row['median_step_seconds']:>9.4f} {ratio:>10.3f}x "
              f"{row['train_loss_last_tenth']:>11.4f} {row['val_loss']:>9.4f} "
              f"{row.get('val_loss_vs_1f1b', math.nan):>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
