"""Case ``vs_torch_pipelining``: pipetrain vs torch.distributed.pipelining, the same training step side by side in one run.

Part 1 (MLP, memory-bound: communication- and overhead-sensitive): 2 ranks (processes),
1 intra-op thread each, gloo on 127.0.0.1. The model is ``depth`` x [Linear(width,
width) + GELU] (full size 8 x 1024; each pair one layer, built from pipetrain's seeded
layer factories, so both frameworks start from the same weights), batch 64 split into 8
micro-batches, MSE loss against a fixed target, SGD. One *training step* is timed as a
whole: forward, backward and the optimizer step (pipetrain: ``Pipeline.train_step``;
torch: ``schedule.step(...)`` + ``optimizer.step()`` + ``zero_grad()``). Every anchor runs
at the settings its users would pick for speed: torch with ``scale_grads=False`` and the
loss divided by the micro-batches instead, and ``zero_grad(set_to_none=False)`` (its
gradient buffers kept between steps, as pipetrain keeps its own;
:data:`pipetrain.bench.vs_torch.runners.TORCH_SETTINGS`); both frameworks' workers keep the
memory they free, as ``pipetrain train``'s CPU workers do (``Options.malloc_tuned``). For every schedule both
frameworks have (:data:`pipetrain.bench.vs_torch.runners.TORCH_VARIANTS`):
gpipe / ``ScheduleGPipe``, 1f1b / ``Schedule1F1B``, interleaved-1f1b /
``ScheduleInterleaved1F1B`` (2 stages per rank), zb-h1 / ``ScheduleInterleavedZeroBubble``
with one stage per rank (ZB-H1's order on 2 ranks) and its 2-stage and V forms,
looped-bfs / ``ScheduleLoopedBFS``, zb-v / ``ScheduleZBVZeroBubble``, dualpipe-v /
``ScheduleDualPipeV``. The ratio of a schedule is taken against the fastest torch
variant; a torch variant that cannot be built or run is reported as not comparable.

Part 2 (the default GPT of ``pipetrain train``: 4 blocks, width 64, 4 heads, context 128,
batch 32, AdamW, clipping 1.0, 1F1B on 2 stages, 8 micro-batches) against the same model
trained in ONE process with 2 intra-op threads (the pipeline's 2 ranks x 1 thread),
alternating step by step; the speedup.

Part 3 (GPT, compute-bound: 8 blocks, width 256, 8 heads, sequence 128, batch 32 in 8
micro-batches, AdamW): every schedule of pipetrain beside torch's classes for it (the
same cut for both: on 2 stages where the ideal 1F1B step is shortest, on 4 stages evening
out the layers' work) and the whole model in one process with 2 threads, interleaved.

Goals (shown under each table; a missed one is listed by ``pipetrain bench``): pipetrain
at least as fast as torch on every schedule of both models; its step within 5% of its
ideal with one stage per rank, 10% with two; on the MLP, its recorded actions within 10%
of the simulator's prediction.

Method: all runners live in the same two processes; after a warm-up, repetitions go
round-robin over them; each timed step starts after a barrier, and the step time is the
max over the ranks; medians. The first two losses of every runner are compared with each
other and with single-process training. pipetrain's recorded actions give its measured
step against the simulator's prediction; torch's stages' compute calls are timed for the
same analysis; both are compared with an *ideal* step: their action order simulated with
the per-stage costs of plain autograd running pipetrain's order of the schedule, timed in
the same loop (both ranks computing, no communication, nothing a pipeline adds). Details: :mod:`pipetrain.bench.vs_torch`. ``--quick``:
smaller models (MLP 8 x 256, batch 32; compute-bound GPT 4 blocks x 128, sequence 64,
batch 16 in 4 micro-batches, gpipe and 1f1b only) and a few repetitions, every schedule
of the MLP kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.drawings import bars, find_table, numbers, quotient
from pipetrain.bench.harness import run_job, spread_warnings
from pipetrain.bench.vs_torch.gpt_speedup import analyse_gpt, gpt_worker
from pipetrain.bench.vs_torch.mlp import analyse_mlp, mlp_worker
from pipetrain.bench.vs_torch.options import Options
from pipetrain.bench.vs_torch.tables import (
    goals,
    gpt_table,
    mlp_tables,
    transformer_tables,
)
from pipetrain.bench.vs_torch.transformer import analyse_transformer, transformer_worker

__all__ = ["CASE", "FULL", "QUICK", "draw", "run"]

FULL = Options()
QUICK = replace(FULL, reps=3, warmup=1, width=256, batch=32,
                gpt_reps=3, gpt_warmup=2, tf_blocks=4, tf_width=128, tf_heads=4, tf_seq=64,
                tf_batch=16, tf_microbatches=4, tf_reps=3, tf_warmup=1, tf_cost_rounds=1,
                tf_schedules=("gpipe", "1f1b"))


def run(context: BenchContext) -> BenchResult:
    """The three parts, each in its own 2-rank job; their tables."""
    opts = QUICK if context.quick else FULL
    parts: list[tuple[str, Callable[..., Any], Callable[[dict[str, Any]], dict[str, Any]]]] = [
        ("mlp", mlp_worker, lambda raw: analyse_mlp(raw, opts)),
        ("gpt", gpt_worker, analyse_gpt),
        ("transformer", transformer_worker, lambda raw: analyse_transformer(raw, opts)),
    ]
    output: dict[str, Any] = {"options": asdict(opts), "world_size": 2, "threads_per_rank": 1}
    for name, worker, analyse in parts:
        context.progress(f"part {name}: 2 ranks x 1 thread")
        began = time.perf_counter()
        raw = run_job(worker, opts, malloc_tuned=opts.malloc_tuned, timeout=opts.timeout)[0]
        output[name] = analyse(raw)
        output[name]["seconds"] = time.perf_counter() - began
    output["goals"] = goals(output)
    tables: list[Table] = [*mlp_tables(output["mlp"], opts), gpt_table(output["gpt"]),
                           *transformer_tables(output["transformer"], opts)]
    return BenchResult(tables=tables, data=output, warnings=_warnings(output))


def _warnings(output: dict[str, Any]) -> list[str]:
    """The runners whose timed repetitions disagree, in every part."""
    samples: dict[str, list[float]] = {}
    for part in ("mlp", "transformer"):
        for schedule, entry in output[part]["schedules"].items():
            for label, row in [(schedule, entry.get("pipetrain")), *entry["torch"].items()]:
                if row and "step_s" in row:
                    samples[f"{part} {'pipetrain ' if label == schedule else ''}{label}"] = \
                        row["step_s"]
    samples["transformer one process"] = output["transformer"].get("single_step_s", [])
    samples.update({f"gpt {k}": v for k, v in output["gpt"].get("step_s", {}).items()})
    return spread_warnings(samples)


_RATIO = "pipetrain / torch throughput"
_BOUND = "bound: torch's step / pipetrain's ideal step"


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Per schedule, pipetrain's throughput over torch's with its bound (torch's step
    over pipetrain's ideal one), for the MLP and the compute-bound GPT: one PNG each.

    Example::

        draw(tables, data, Path("bench-results/full"))  # ['vs_torch_pipelining_mlp.png', ...]
    """
    mlp, transformer = find_table(tables, "mlp"), find_table(tables, "transformer")
    names = bars(out / "vs_torch_pipelining_mlp.png", mlp, "schedule",
                 {_RATIO: "pipetrain / torch throughput", _BOUND: "bound"},
                 title="Memory-bound MLP: pipetrain / torch.distributed.pipelining "
                       "throughput per schedule", ylabel="ratio", reference=1.0)
    if transformer is not None:
        bound = "bound" if "bound" in transformer.columns else quotient(
            numbers(transformer, "torch ms"), numbers(transformer, "ideal ms"))
        names += bars(out / "vs_torch_pipelining_transformer.png", transformer, "schedule",
                      {_RATIO: "pipetrain / torch throughput", _BOUND: bound},
                      title="Compute-bound GPT: pipetrain / torch.distributed.pipelining "
                            "throughput per schedule", ylabel="ratio", reference=1.0)
    return names


CASE = Case(name="vs_torch_pipelining",
            title="Pipeline vs torch.distributed.pipelining: every schedule, memory- and "
                  "compute-bound models",
            run=run, draw=draw, quick_seconds=25, full_seconds=790)
