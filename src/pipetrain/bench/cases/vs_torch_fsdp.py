"""Case ``vs_torch_fsdp``: pipeline x FSDP2, pipetrain against torch.distributed.pipelining in fully_shard.

The same GPT on 4 processes, a mesh of P = 2 pipeline ranks x D = 2 data-parallel ranks,
each stage sharded over its 2 dp ranks by FSDP2's ``fully_shard``: pipetrain's
``Pipeline(data_parallel="fsdp")`` against torchtitan's recipe on
``torch.distributed.pipelining`` (see :mod:`._fsdp_runs`), for the schedules both have
(GPipe, 1F1B), at the same FSDP policy (parameters gathered once per step, gradients
reduce-scattered once per step), and pipetrain with both of its FSDP savings on
(``reshard_after_forward``, ``reduce_each_microbatch``) beside them. Time: one job, the
runners interleaved step by step (same weights and batches; their first two losses
checked). Memory: each runner in a job of its own, every rank's resident growth over its
first 3 steps from after the model was built (glibc's mmap threshold fixed at 64 KiB, so
that the resident set follows the live tensors). ``--quick``: a small GPT, few steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.cases._fsdp_runs import (
    LIBRARIES,
    TORCH_CLASSES,
    Sizes,
    memory_worker,
    timing_worker,
)
from pipetrain.bench.drawings import bars, find_table
from pipetrain.bench.harness import (
    EXACT_MALLOC,
    foreign_load,
    load_line,
    median,
    run_job,
    step_times,
)
from pipetrain.launch.processes import temporary_environment

__all__ = ["CASE", "SIZES", "draw", "run", "table"]

SIZES = {
    "full": Sizes(blocks=14, width=128, heads=4, seq=64, batch=16, microbatches=4, reps=30),
    "quick": Sizes(blocks=4, width=64, heads=2, seq=32, batch=8, microbatches=2, reps=2),
}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def table(raw: dict[str, Any], sizes: Sizes) -> Table:
    """The comparison: per schedule and runner, the median step, pipetrain's throughput
    over torch's, each rank's peak and the largest over torch's; the goals (pipetrain at
    the anchor's policy at least as fast, its largest peak at most torch's)."""
    rows: list[list[Any]] = []
    goals: list[Goal] = []
    for schedule in raw["schedules"]:
        steps = {lib: raw["step_ms"][f"{lib} {schedule}"] for lib in LIBRARIES}
        peaks = {lib: raw["peak_mib"][f"{lib} {schedule}"] for lib in LIBRARIES}
        for lib in LIBRARIES:
            speed = _ratio(steps["torch"], steps[lib])
            memory = _ratio(max(peaks[lib]), max(peaks["torch"]))
            rows.append([schedule, lib, round(steps[lib], 1),
                         "-" if lib == "torch" else f"{speed:.2f}x",
                         " / ".join(f"{p:.1f}" for p in peaks[lib]), max(peaks[lib]),
                         "-" if lib == "torch" else f"{memory:.2f}x",
                         " ".join(f"{v:.4f}" for v in raw["losses"][f"{lib} {schedule}"])])
        goals.append(Goal.at_least(f"{schedule}: pipetrain / torch throughput",
                                   _ratio(steps["torch"], steps["pipetrain"]), 1.0, unit="x"))
        goals.append(Goal.at_most(f"{schedule}: pipetrain / torch largest peak per rank",
                                  _ratio(max(peaks["pipetrain"]), max(peaks["torch"])), 1.0,
                                  unit="x"))
    return Table(
        key="mesh",
        title="Pipeline x FSDP2 on a (pp = 2, dp = 2) mesh: pipetrain vs "
              "torch.distributed.pipelining stages in fully_shard",
        columns=["schedule", "runner", "median step ms", "throughput / torch",
                 "peak MiB per rank (ranks 0-3)", "largest peak MiB", "largest peak / torch",
                 "first two losses"],
        rows=rows,
        anchor=("torchtitan's recipe on torch.distributed.pipelining (fully_shard on every "
                "layer and on the stage, reshard_after_forward=False, PipelineStage on the "
                "pp group, " + ", ".join(f"{c} for {s}" for s, c in TORCH_CLASSES.items())
                + ", scale_grads=False with the loss divided by the micro-batches, "
                "gradients kept between steps), in the same processes, interleaved"),
        notes=(f"GPT of {sizes.blocks} blocks of width {sizes.width} ({sizes.heads} heads), "
               f"embedding and head untied, {sizes.batch} sequences of {sizes.seq} tokens per "
               f"step ({sizes.batch // sizes.replicas} per replica, {sizes.microbatches} "
               f"micro-batches each), AdamW; the layers cut {sizes.cut()} (embedding and "
               f"head included); 4 processes of one intra-op thread each on the machine's "
               f"cores, gloo. 'pipetrain': the anchor's policy (parameters gathered once per "
               f"step and kept, gradients reduce-scattered once per step); 'pipetrain-lean': "
               f"reshard_after_forward and reduce_each_microbatch (parameters gathered for "
               f"every forward and backward, gradients reduce-scattered after each backward). "
               f"Median of {sizes.reps} interleaved steps (rotating which runner goes first). "
               f"Peak: each rank's resident growth over its first 3 steps from after the "
               f"model was built (parameters sharded; gradients, AdamW state, gathered "
               f"parameters and activations counted), each runner in its own processes, "
               f"glibc's mmap threshold at 64 KiB. Losses: the mean over the global batch "
               f"(torch's from its last stage's two replicas). {load_line(raw['load'])}."),
        goals=goals)


def run(context: BenchContext) -> BenchResult:
    """Time every runner in one job, then measure each one's memory in its own job."""
    sizes = SIZES["quick" if context.quick else "full"]
    schedules = list(TORCH_CLASSES)
    world = sizes.stages * sizes.replicas
    context.progress(f"timing {len(schedules) * len(LIBRARIES)} runners, {sizes.reps} steps each")
    ranks = run_job(timing_worker, sizes, schedules, world_size=world, timeout=1800)
    step_ms = {label: 1000 * median(step_times([r["samples"] for r in ranks], label))
               for label in ranks[0]["samples"]}
    peak_mib: dict[str, list[float]] = {}
    for schedule in schedules:
        for library in LIBRARIES:
            context.progress(f"memory of {library} {schedule}")
            with temporary_environment(EXACT_MALLOC):  # read by each process's allocator
                peak_mib[f"{library} {schedule}"] = run_job(
                    memory_worker, sizes, library, schedule, world_size=world, timeout=600)
    raw = {"schedules": schedules, "step_ms": step_ms, "peak_mib": peak_mib,
           "losses": ranks[0]["losses"],
           "load": foreign_load([r["cpu_window"] for r in ranks]),
           "step_s": {label: step_times([r["samples"] for r in ranks], label)
                      for label in ranks[0]["samples"]}}
    return BenchResult(tables=[table(raw, sizes)],
                       data={"raw": raw, "sizes": dataclasses.asdict(sizes)})


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Each runner's largest peak per rank and its step, per schedule: one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['vs_torch_fsdp_memory.png']
    """
    return bars(out / "vs_torch_fsdp_memory.png", find_table(tables, "mesh"),
                ["schedule", "runner"], {"largest peak MiB": "largest peak MiB"},
                title="Pipeline x FSDP2 (pp 2 x dp 2): the largest peak per rank",
                ylabel="MiB")


CASE = Case(name="vs_torch_fsdp",
            title="Pipeline x FSDP2: pipetrain vs torch.distributed.pipelining stages in "
                  "fully_shard (torchtitan's recipe), step time and memory per rank",
            run=run, draw=draw, quick_seconds=40, full_seconds=240)
