"""pipetrain vs torch.distributed.pipelining: the same training step, side by side, in one run.

What it measures
----------------
Part 1 (MLP, communication- and overhead-sensitive): 2 ranks (processes), 1 intra-op
thread each, gloo on 127.0.0.1. The model is ``depth`` x [Linear(width, width) + GELU]
(default 8 x 1024; each pair one layer, built from pipetrain's seeded layer factories, so
both frameworks start from the same weights), batch 64 split into 8 micro-batches, MSE
loss against a fixed target, SGD. One *training step* is timed as a whole: forward,
backward and the optimizer step (pipetrain: ``Pipeline.train_step``, which also returns
the mean loss on every rank; torch: ``schedule.step(...)`` + ``optimizer.step()`` +
``zero_grad()``, nothing else). For every schedule both frameworks have:

=================  ============================  =========================================
name               pipetrain                     torch.distributed.pipelining
=================  ============================  =========================================
gpipe              ``gpipe``                     ``ScheduleGPipe``
1f1b               ``1f1b``                      ``Schedule1F1B``
interleaved-1f1b   ``interleaved-1f1b``, V = 2    ``ScheduleInterleaved1F1B``, 2 stages/rank
zero-bubble        ``zb-h1`` (1 stage per rank)  ``ScheduleInterleavedZeroBubble`` with 2
                                                 stages per rank (loop placement) and
                                                 ``ScheduleZBVZeroBubble`` (V placement)
looped-bfs         ``looped-bfs``, V = 2          ``ScheduleLoopedBFS``, 2 stages/rank
zb-v               ``zb-v`` (V placement)         ``ScheduleZBVZeroBubble``
dualpipe-v         ``dualpipe-v`` (V placement)   ``ScheduleDualPipeV``
=================  ============================  =========================================

torch has no ZB-H1 as such; its zero-bubble schedules are written for several stages per
rank. ``ScheduleInterleavedZeroBubble`` given ONE stage per rank runs exactly ZB-H1's action
order on 2 ranks (the script checks the order torch actually ran against pipetrain's), so it
is the like-for-like comparison; its 2-stages-per-rank form and ``ScheduleZBVZeroBubble``
(which needs exactly 2 stages per rank, V placement) cut the model into 4 stages instead of
2 (same compute, twice the stage boundaries) and are reported too. The ratio of a schedule
is taken against the fastest torch variant. A torch variant that cannot be built or run
is reported as "torch: not comparable (reason)".

Method: all runners (every framework x schedule) live in the same two processes; after a
warm-up, repetitions go round-robin over them; each timed step starts after a barrier and
is timed with ``perf_counter`` on each rank, the step time being the max over the ranks.
Figures are medians over repetitions. The losses of the first two steps of every runner
are compared with each other and with the whole model trained in one process (same
weights, same batches: the same work).

Where the time goes. pipetrain records every action it runs; the script gathers both
ranks' actions of every timed step, puts them on one time axis (``offsets_from_origins``)
and compares the makespan with the simulator's prediction from the costs measured in the
same step (``simulate(pipe.schedule(M), measure_step(...).mean_costs)``); it also gives
the prediction with the time the sends took on the sender added to the compute before
them (the simulator counts a send as free). For torch the forward / backward calls of its
stages and its optimizer step are timed (two ``perf_counter`` reads per call; switch off
with ``--no-trace-torch``), which gives torch's busy time, its own makespan and the same
simulator comparison on the order torch ran; torch's gradient scaling (every gradient
divided by M after the last backward) is shown apart. As a framework-neutral yardstick
both are compared with an *ideal* step: their action order simulated with per-stage
forward / backward / SGD costs measured in isolation (plain autograd on the stage modules,
both ranks at once, no communication; a split backward counts as half + half of the full
one). ``bound`` = torch's step / pipetrain's ideal step: the ratio a zero-overhead
pipetrain would reach. Per rank and step the script also reports the CPU time of the main
thread and of all other threads of the process (pipetrain's receive threads, gloo's device
threads, monitors): on 2 cores busy with 2 ranks, background CPU is taken from compute.

``--malloc-tuned`` runs the workers with glibc's ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` raised, so that freed memory is kept: with the defaults the 4 MB
weight-gradient temporaries of a backward page-fault on every micro-batch, which doubles
the cost of the zero-bubble schedules' weight passes (``W``) in both frameworks.

Part 2 (GPT, small): the default model of ``pipetrain train`` (GPTConfig(
num_layers=4, width=64, num_heads=4, context=128), batch 32, AdamW lr 3e-3 with betas
(0.9, 0.95) and weight decay 0.1, gradient clipping at 1.0, 1F1B, 2 stages, 8
micro-batches; no LR schedule) trained by pipetrain on 2 ranks x 1 thread vs the same
model trained in ONE process with 1 thread (plain PyTorch, same batches, same optimizer,
same clipping), alternating step by step; the speedup of the medians (ideal: 2x).

Part 3 (GPT, compute-bound, ``--transformer``): a GPT of 8 transformer blocks, width 256,
8 heads, sequence 128, batch 32 in 8 micro-batches, AdamW, 2 ranks x 1 thread:
pipetrain's ``gpipe`` and ``1f1b`` beside torch's ``ScheduleGPipe`` and ``Schedule1F1B``
(the same cut for both, chosen where the ideal step below is shortest; torch's gradient
scaling folded into its loss, its fastest equivalent) and the whole model in one process,
interleaved. The ideal step simulates each order with every layer's costs measured on a
micro-batch in one process alone; the report splits each step's distance from it into
contention between the two processes, compute in the step, waits and messages, and what
runs outside the actions. See ``vs_torch/transformer.py``.

Code: the runners and analyses live in ``benchmarks/vs_torch/``, the job launch,
interleaved timing, statistics, machine load and JSON output in ``benchmarks/harness/``
(shared with the other benchmarks).

Run it
------
::

    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py            # all three parts
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --json     # one JSON object
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --mlp --reps 5 --warmup 2
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --gpt
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --malloc-tuned
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --transformer --tf-reps 15

(``python`` being the project's virtual environment; ~70 s for parts 1 and 2 on 2 cores,
several minutes for part 3.)

Goals
-----
* pipetrain >= 1.2x torch's throughput (steps/s) on every schedule both have (MLP);
* pipetrain >= 1.1x torch's throughput on gpipe and 1f1b (compute-bound GPT);
* pipetrain's measured step within 10% of the simulator's prediction from its measured
  action costs.

The machine should be quiet: with 2 processes on 2 cores anything else running shows up
directly in the figures (and hurts the 2-process pipeline more than the 1-process
baseline of part 2). The script reports the CPU that other processes used during each
timed loop (from ``/proc/stat``, minus our own processes' CPU time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from pipetrain.bench.harness import dump_json, machine_info, pct, run_job
from vs_torch.gpt_speedup import analyse_gpt, gpt_worker
from vs_torch.mlp import analyse_mlp, mlp_worker
from vs_torch.report import (
    GOAL_COMPUTE_BOUND,
    GOAL_GAP,
    GOAL_RATIO,
    print_gpt,
    print_mlp,
    print_transformer,
)
from vs_torch.runners import TORCH_VARIANTS
from vs_torch.transformer import analyse_transformer, transformer_worker

SCHEDULES = tuple(TORCH_VARIANTS)
"""pipetrain's schedules compared on the MLP, by the name used in the report."""
TRANSFORMER_SCHEDULES = ("gpipe", "1f1b")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--mlp", action="store_true", help="run only part 1 (MLP vs torch)")
    part.add_argument("--gpt", action="store_true", help="run only part 2 (GPT speedup)")
    part.add_argument("--transformer", action="store_true",
                      help="run only part 3 (compute-bound GPT vs torch and one process)")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps (default 5)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated subset of {','.join(SCHEDULES)}")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--gpt-reps", type=int, default=None,
                        help="timed GPT steps (default: --reps)")
    parser.add_argument("--gpt-warmup", type=int, default=None,
                        help="GPT warm-up steps (default: --warmup)")
    parser.add_argument("--isolated-repeats", type=int, default=48,
                        help="micro-batches timed per stage for the isolated costs (default 48)")
    tf = parser.add_argument_group("part 3, the compute-bound GPT")
    tf.add_argument("--tf-blocks", type=int, default=8)
    tf.add_argument("--tf-width", type=int, default=256)
    tf.add_argument("--tf-heads", type=int, default=8)
    tf.add_argument("--tf-seq", type=int, default=128)
    tf.add_argument("--tf-batch", type=int, default=32)
    tf.add_argument("--tf-microbatches", type=int, default=8)
    tf.add_argument("--tf-balance", default="auto",
                    help="layers per stage, e.g. 5,5, or auto (default): the cut whose ideal "
                         "1F1B step is shortest")
    tf.add_argument("--tf-schedules", default=",".join(TRANSFORMER_SCHEDULES),
                    help="comma-separated subset of gpipe,1f1b")
    tf.add_argument("--tf-reps", type=int, default=None, help="timed steps (default: --reps)")
    tf.add_argument("--tf-warmup", type=int, default=3, help="warm-up steps (default 3)")
    tf.add_argument("--tf-cost-rounds", type=int, default=2,
                    help="rounds of M micro-batches timed per layer for the ideal (default 2)")
    parser.add_argument("--no-trace-torch", dest="trace_torch", action="store_false",
                        help="do not time torch's compute calls (by default each forward / "
                             "backward call of its stages is timed: ~1 us per call)")
    parser.add_argument("--malloc-tuned", action="store_true",
                        help="run the workers with glibc's MALLOC_TRIM_THRESHOLD_=1 GiB and "
                             "MALLOC_MMAP_THRESHOLD_=64 MiB (no page faults on large "
                             "temporaries; both frameworks alike)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a stuck job is killed (default 1800)")
    parser.add_argument("--torch-timeout", type=float, default=120.0,
                        help="timeout of torch's process groups (default 120)")
    opts = parser.parse_args(argv)
    opts.schedules = [s.strip() for s in opts.schedules.split(",") if s.strip()]
    unknown = [s for s in opts.schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    opts.tf_schedules = [s.strip() for s in opts.tf_schedules.split(",") if s.strip()]
    unknown = [s for s in opts.tf_schedules if s not in TRANSFORMER_SCHEDULES]
    if unknown:
        parser.error(f"unknown --tf-schedules {unknown}; choose from "
                     f"{', '.join(TRANSFORMER_SCHEDULES)}")
    if opts.batch % opts.microbatches:
        parser.error(f"--batch {opts.batch} is not a multiple of --microbatches {opts.microbatches}")
    if opts.tf_batch % opts.tf_microbatches:
        parser.error(f"--tf-batch {opts.tf_batch} is not a multiple of --tf-microbatches "
                     f"{opts.tf_microbatches}")
    if opts.tf_balance != "auto":
        try:
            balance = [int(v) for v in opts.tf_balance.split(",")]
        except ValueError:
            balance = []
        if len(balance) != 2 or sum(balance) != opts.tf_blocks + 2 or min(balance) < 1:
            parser.error(f"--tf-balance {opts.tf_balance!r}: give 2 positive layer counts "
                         f"adding up to {opts.tf_blocks + 2} (embedding, blocks, head), e.g. "
                         f"{(opts.tf_blocks + 2) // 2},{(opts.tf_blocks + 3) // 2}, or auto")
    if opts.depth % 4:
        parser.error(f"--depth {opts.depth} must be a multiple of 4 (2 ranks x up to 2 stages)")
    opts.gpt_reps = opts.reps if opts.gpt_reps is None else opts.gpt_reps
    opts.gpt_warmup = opts.warmup if opts.gpt_warmup is None else opts.gpt_warmup
    opts.tf_reps = opts.reps if opts.tf_reps is None else opts.tf_reps
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    output: dict[str, Any] = {"machine": machine_info(), "config": {
        k: v for k, v in vars(opts).items() if k not in ("json", "timeout")}}
    output["config"].update({"world_size": 2, "threads_per_rank": 1})
    if not opts.json:
        m = output["machine"]
        print(f"machine: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}, "
              f"load average {m['loadavg_start']}")
        if opts.malloc_tuned:
            print("workers run with MALLOC_TRIM_THRESHOLD_=1 GiB, MALLOC_MMAP_THRESHOLD_=64 MiB")
    started = time.perf_counter()
    parts = [("mlp", mlp_worker, analyse_mlp, print_mlp, not (opts.gpt or opts.transformer)),
             ("gpt", gpt_worker, lambda raw, _: analyse_gpt(raw), lambda r, _: print_gpt(r),
              not (opts.mlp or opts.transformer)),
             ("transformer", transformer_worker, analyse_transformer,
              lambda r, _: print_transformer(r), not (opts.mlp or opts.gpt))]
    for name, worker, analyse, report, wanted in parts:
        if not wanted:
            continue
        began = time.perf_counter()
        raw = run_job(worker, opts, malloc_tuned=opts.malloc_tuned, timeout=opts.timeout)[0]
        output[name] = analyse(raw, opts)
        output[name]["seconds"] = time.perf_counter() - began
        if not opts.json:
            report(output[name], opts)
    output["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    output["seconds"] = time.perf_counter() - started
    output["goals"] = goals(output)
    if opts.json:
        print(dump_json(output))
    else:
        print(f"\nload average at the end: {output['machine']['loadavg_end']}; "
              f"{output['seconds']:.0f} s in all")
        for line in output["goals"]["lines"]:
            print(line)
    return 0


def goals(output: dict[str, Any]) -> dict[str, Any]:
    """Which goals the run met, and one line each."""
    lines = []
    met: dict[str, Any] = {}
    for schedule, entry in output.get("mlp", {}).get("schedules", {}).items():
        ratio = entry.get("ratio")
        gap = entry["pipetrain"]["gap"] if entry.get("pipetrain") else None
        met[schedule] = {"throughput": None if ratio is None else ratio >= GOAL_RATIO,
                         "simulator": None if gap is None else abs(gap) <= GOAL_GAP}
        lines.append(f"goal {schedule:17} throughput >= {GOAL_RATIO}x torch: "
                     f"{'-' if ratio is None else ('met' if ratio >= GOAL_RATIO else 'MISSED')}"
                     f" ({'-' if ratio is None else f'{ratio:.2f}x'}); within {GOAL_GAP:.0%} of "
                     f"the simulator: {'-' if gap is None else ('met' if abs(gap) <= GOAL_GAP else 'MISSED')}"
                     f" ({pct(gap)})")
    for schedule, entry in output.get("transformer", {}).get("schedules", {}).items():
        ratio = entry.get("ratio")
        met[f"transformer {schedule}"] = None if ratio is None else ratio >= GOAL_COMPUTE_BOUND
        lines.append(f"goal compute-bound {schedule:6} throughput >= {GOAL_COMPUTE_BOUND}x torch: "
                     f"{'-' if ratio is None else ('met' if ratio >= GOAL_COMPUTE_BOUND else 'MISSED')}"
                     f" ({'-' if ratio is None else f'{ratio:.2f}x'})")
    return {"per_schedule": met, "lines": lines}


if __name__ == "__main__":
    sys.exit(main())
