"""The main job, inside one worker: train the GPT as a pipeline and write the run folder.

Every rank runs this loop; rank 0 shows the progress and writes the run folder:
``config.json``, ``metrics.json`` (per-step loss, throughput, measured bubble, per-stage
busy/idle, peak memory), ``timeline.png`` (the measured per-stage timeline of the last
step), ``trace.json`` (Chrome trace of the last steps), ``sample.txt`` and the sharded
``checkpoint/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.api.pipeline import Pipeline
from pipetrain.cli.train import _pipeline_config
from pipetrain.data import ByteTokenizer, TextDataset, load_corpus
from pipetrain.models import GPTConfig, generate, gpt_layer_factories, gpt_loss, gpt_ties
from pipetrain.runtime.process_group import init_distributed
from pipetrain.schedule import TimedAction, simulate
from pipetrain.trace import (
    ProgressBar,
    measure_step,
    offsets_from_origins,
    render_measured_timeline,
    write_chrome_trace,
)

__all__ = ["train_worker"]

logger = logging.getLogger(__name__)

_TRACE_STEPS = 3
"""How many final steps go into trace.json."""


def _lr_lambda(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _checkpoint_dir(path: str) -> str:
    nested = os.path.join(path, "checkpoint")
    return nested if os.path.isdir(nested) else path


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _gather_step(pipe: Pipeline) -> list[tuple[float, list[TimedAction]]] | None:
    """Every rank's (wall-clock origin, actions) of the last step, on rank 0."""
    mine = (pipe.last_step_start, pipe.last_timeline)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    return gathered if dist.get_rank() == 0 else None


def _one_axis(gathered: list[tuple[float, list[TimedAction]]]) -> list[TimedAction]:
    offsets = offsets_from_origins([origin for origin, _ in gathered])
    return [
        TimedAction(rank, t.action, t.start + offsets[rank], t.end + offsets[rank])
        for rank, (_, actions) in enumerate(gathered)
        for t in actions
    ]


def train_worker(args: argparse.Namespace) -> int:
    """Train on this rank (called in every worker); 0 on success."""
    context = init_distributed(timeout=args.timeout)
    rank = context.rank
    if args.out is None:  # under torchrun without --out: every rank takes rank 0's folder
        chosen = [os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))]
        dist.broadcast_object_list(chosen, src=0)
        args.out = chosen[0]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_config = GPTConfig(context=args.context, num_layers=args.layers, width=args.width,
                             num_heads=args.heads, dropout=args.dropout)
    config = _pipeline_config(args)
    dataset = TextDataset(load_corpus(args.data), context=args.context, seed=args.seed)
    pipe = Pipeline(
        gpt_layer_factories(model_config, seed=args.seed),
        loss_fn=gpt_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95),
                                                   weight_decay=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args.warmup, args.steps)),
        ties=gpt_ties(model_config),
        config=config,
        context=context,
    )
    try:
        return _train(pipe, args, dataset, model_config, rank)
    except BaseException:
        logger.exception("rank %d failed", rank)
        raise
    finally:
        pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(pipe: Pipeline, args: argparse.Namespace, dataset: TextDataset,
           model_config: GPTConfig, rank: int) -> int:
    out = args.out
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"args": vars(args) | {"run": None}, "model": model_config.__dict__,
                       "world_size": dist.get_world_size()}, f, indent=2, default=str)
    start = 0
    if args.resume is not None:
        pipe.load(_checkpoint_dir(args.resume))
        start = pipe.step
        if rank == 0:
            logger.info("resumed from %s at step %d", args.resume, start)
    tokens_per_step = args.batch_size * args.context
    records: list[dict[str, Any]] = []
    traced: list[list[TimedAction]] = []
    measures = []
    bar = ProgressBar(args.steps, initial_step=start) if rank == 0 else None
    first_loss = None
    for step in range(start, args.steps):
        inputs, targets = dataset.batch(step, args.batch_size)
        began = time.perf_counter()
        loss = pipe.train_step(inputs, targets)
        seconds = time.perf_counter() - began
        gathered = _gather_step(pipe)
        if rank == 0:
            assert gathered is not None and bar is not None
            timeline = _one_axis(gathered)
            measure = measure_step(timeline, num_ranks=len(gathered))
            measures.append(measure)
            if step >= args.steps - _TRACE_STEPS:
                traced.append(timeline)
            first_loss = loss if first_loss is None else first_loss
            record = {"step": step + 1, "loss": loss, "seconds": seconds,
                      "tokens_per_s": tokens_per_step / seconds,
                      "bubble": measure.bubble_fraction,
                      "lr": pipe.optimizers.optimizers[min(pipe.local_stages)].param_groups[0]["lr"]}
            if pipe.grad_norm is not None:
                record["grad_norm"] = pipe.grad_norm
            bar.update(step + 1, loss=loss, tokens_per_s=record["tokens_per_s"], bubble=measure.bubble_fraction)
            records.append(record)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            val_inputs, val_targets = dataset.batch(step, args.batch_size, split="val")
            val = pipe.eval_step(val_inputs, val_targets)
            if rank == 0:
                records[-1]["val_loss"] = val
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            pipe.save(os.path.join(out, "checkpoint"), extra={"data_step": step + 1})
    if bar is not None:
        bar.close()
    pipe.save(os.path.join(out, "checkpoint"), extra={"data_step": args.steps})
    memory: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(memory, {"rank": rank, "stages": list(pipe.local_stages),
                                    "peak_memory_bytes": _peak_memory_bytes(pipe.device)})
    sample = _sample(pipe, args, model_config) if args.sample_bytes > 0 else None
    if rank == 0:
        _write_run(out, args, records, measures, traced, memory, sample, pipe)
        _report(out, records, first_loss, sample)
    return 0


def _sample(pipe: Pipeline, args: argparse.Namespace, model_config: GPTConfig) -> str:
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode("def ")
    generator = torch.Generator().manual_seed(args.seed)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        output = pipe.eval_step(ids, broadcast=True)
        assert isinstance(output, torch.Tensor)
        return output

    tokens = generate(logits, prompt, num_tokens=args.sample_bytes, temperature=0.8, top_k=40,
                      generator=generator, context=model_config.context)
    return tokenizer.decode(tokens.reshape(-1))


def _write_run(out: str, args: argparse.Namespace, records: list[dict[str, Any]], measures: list[Any],
               traced: list[list[TimedAction]], memory: list[Any], sample: str | None,
               pipe: Pipeline) -> None:
    steady = measures[len(measures) // 5:] or measures
    per_rank_busy = [statistics.median(m.busy[r] for m in steady) for r in range(len(memory))] if steady else []
    per_rank_idle = [statistics.median(m.idle[r] for m in steady) for r in range(len(memory))] if steady else []
    prediction = None
    if traced:
        last = measure_step(traced[-1], num_ranks=len(memory))
        try:
            predicted = simulate(pipe.schedule(pipe.config.num_microbatches), last.mean_costs).makespan
            prediction = {"measured_step_s": last.makespan, "simulated_step_s": predicted}
        except (TypeError, ValueError) as error:
            logger.debug("no simulator prediction: %s", error)
    throughput = [r["tokens_per_s"] for r in records[len(records) // 5:]] or [0.0]
    metrics = {
        "config": {"args": vars(args), "world_size": len(memory)},
        "steps": records,
        "summary": {
            "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "median_tokens_per_s": statistics.median(throughput),
            "median_step_s": statistics.median(r["seconds"] for r in records) if records else None,
            "median_bubble": statistics.median(m.bubble_fraction for m in steady) if steady else None,
            "busy_s_per_rank": per_rank_busy,
            "idle_s_per_rank": per_rank_idle,
            "prediction": prediction,
        },
        "memory": memory,
        "sample": sample,
    }
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2, default=str)
    if traced:
        render_measured_timeline(traced[-1], os.path.join(out, "timeline.png"),
                                 title=f"{args.schedule}: measured step {records[-1]['step']} "
                                       f"({args.stages} stages x {args.replicas} replicas, "
                                       f"{args.microbatches} micro-batches)")
        write_chrome_trace(traced, os.path.join(out, "trace.json"),
                           metadata={"schedule": args.schedule, "stages": args.stages})
    if sample is not None:
        with open(os.path.join(out, "sample.txt"), "w") as f:
            f.write(sample)


def _report(out: str, records: list[dict[str, Any]], first_loss: float | None, sample: str | None) -> None:
    if not records:
        return
    last = records[-1]
    lines = [
        f"trained {last['step']} steps: loss {first_loss:.3f} -> {last['loss']:.3f}"
        + (f" (validation {last['val_loss']:.3f})" if "val_loss" in last else ""),
        f"run folder: {out}  (metrics.json, timeline.png, trace.json, checkpoint/, sample.txt)",
    ]
    if sample is not None:
        lines += ["sample:", sample]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
