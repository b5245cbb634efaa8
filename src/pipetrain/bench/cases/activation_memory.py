"""Case ``activation_memory``: what each rank holds for backward, measured and simulated, per schedule and recomputation mode.

A GPT (embedding, 8 blocks of width 256, head; 4 sequences of 256 tokens per
micro-batch, AdamW) trains on P = 2 and P = 4 processes (one thread each), M = 4P
micro-batches per step, under 1F1B, ZB-V, V-Half and V-Min (every stage keeping its
activations), and under 1F1B with re-materialization on the first half of the stages
only (one mode per stage), with selective and with per-layer recomputation on every
stage. Each run
takes two steps (weights, gradients and optimizer state allocated), then every rank
measures one step's peak: its resident set's growth above the start of the step
(:class:`~pipetrain.bench.harness.PeakMemory`, malloc trimmed first). The simulator
(:func:`pipetrain.schedule.activation_peaks`) gets each stage's saved bytes per
micro-batch from the profiler (rank 0 profiles every layer on one micro-batch) and the
same cut (:func:`~pipetrain.bench.cases._schedules_sim.stage_balance`), and the
temporary memory of a running backward (the largest of the stage's layers', also
profiled); selective recomputation (no profiled figure for what it keeps) and per-layer
recomputation (the profile here has no layer inputs) are measured only.

Every stage of the V schedules holds half a 1F1B stage's layers, so the V schedules'
busiest rank compares with 1F1B's directly. ``--quick``: width 64, 64 tokens, P = 2.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.cases._schedules_runs import ModelSpec, profile_costs
from pipetrain.bench.cases._schedules_sim import ModelCosts, stage_balance
from pipetrain.bench.harness import EXACT_MALLOC, run_job
from pipetrain.launch.processes import temporary_environment

__all__ = ["CASE", "EXACT_MALLOC", "GOAL_DEVIATION", "GOAL_RATIO", "SIZES", "Run", "draw", "run",
           "runs", "simulated_mib", "worker"]

_MIB = float(1 << 20)



@dataclasses.dataclass(frozen=True)
class Run:
    """One measured configuration: a schedule and each stage's mode (comma-joined)."""

    schedule: str
    checkpoint: str = "never"


def runs(ranks: int) -> list[Run]:
    """The configurations measured on ``ranks`` processes.

    Example:
        >>> [r.checkpoint for r in runs(2)][-3:]
        ['always,never', 'selective', 'per_layer']
    """
    half = ",".join(["always"] * (ranks // 2) + ["never"] * (ranks - ranks // 2))
    return [Run("1f1b"), Run("zb-v"), Run("v-half"), Run("v-min"), Run("1f1b", half),
            Run("1f1b", "selective"), Run("1f1b", "per_layer")]


SIZES = {
    "full": (ModelSpec(name="GPT", kind="gpt", depth=10, width=256, heads=4, context=256,
                       microbatch_size=4), (2, 4)),
    "quick": (ModelSpec(name="GPT", kind="gpt", depth=10, width=64, heads=4, context=64,
                        microbatch_size=2), (2,)),
}


def worker(ctx: Any, spec: ModelSpec) -> dict[str, Any]:
    """On each rank: the profile (rank 0), then per configuration two steps and one
    measured step; rank 0 returns the profile and every rank's peaks."""
    import torch
    import torch.distributed as dist

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.bench.harness import PeakMemory, gather_objects
    from pipetrain.schedule import default_stages_per_rank

    torch.set_num_threads(1)
    ranks = ctx.world_size
    microbatches = 4 * ranks
    mine = profile_costs(spec, warmup=1, repetitions=2) if ctx.rank == 0 else None
    dist.barrier()
    costs: ModelCosts = gather_objects(mine)[0]
    x, y = spec.batch(microbatches)
    peaks: dict[str, float] = {}
    for measured in runs(ranks):
        virtual = default_stages_per_rank(measured.schedule)
        balance = stage_balance(costs, ranks * virtual)
        pipe = Pipeline(spec.factories(), loss_fn=spec.loss, optimizer=spec.optimizer,
                        config=PipelineConfig(schedule=measured.schedule, num_stages=ranks,
                                              stages_per_rank=virtual,
                                              num_microbatches=microbatches, balance=balance,
                                              checkpoint=measured.checkpoint,
                                              nonfinite="ignore"),
                        context=ctx)
        for _ in range(2):
            pipe.train_step(x, y)
        meter = PeakMemory([torch.device("cpu")])
        dist.barrier()
        meter.start()
        pipe.train_step(x, y)
        peaks[f"{measured.schedule} {measured.checkpoint}"] = meter.peak_mib()
        pipe.close()
        del pipe
        gc.collect()
    everyone = gather_objects(peaks)
    if ctx.rank != 0:
        return {}
    return {"costs": dataclasses.asdict(costs), "peaks": everyone}


def simulated_mib(costs: ModelCosts, measured: Run, ranks: int) -> list[float] | None:
    """Per rank, the simulator's peak activation MiB of a configuration (None: selective
    and per-layer, measured only).

    Example:
        >>> costs = ModelCosts.uniform(4, forward=1.0, backward=2.0, activation_bytes=1 << 20)
        >>> simulated_mib(costs, Run("1f1b"), 2), simulated_mib(costs, Run("v-half"), 2)
        ([4.0, 2.0], [2.0, 2.0])
    """
    from pipetrain.schedule import (
        StageBytes,
        activation_peaks,
        build_schedule,
        default_stages_per_rank,
    )

    modes = measured.checkpoint.split(",")
    if "selective" in modes or "per_layer" in modes:
        return None
    virtual = default_stages_per_rank(measured.schedule)
    balance = stage_balance(costs, ranks * virtual)
    schedule = build_schedule(measured.schedule, num_ranks=ranks, num_microbatches=4 * ranks,
                              stages_per_rank=virtual, communication=False)
    stages, first = [], 0
    for count in balance:
        layers = slice(first, first + count)
        stages.append(StageBytes(saved=float(sum(costs.activation_bytes[layers])),
                                 workspace=float(max(costs.workspace_bytes[layers], default=0)),
                                 input_workspace=float(max(costs.input_workspace_bytes[layers],
                                                           default=0))))
        first += count
    if len(modes) == 1:
        modes = modes * len(stages)
    peaks = activation_peaks(schedule, stages, modes=modes).per_rank
    return [p / _MIB for p in peaks]


GOAL_RATIO = {"v-half": 0.55, "v-min": 0.40}
"""The most each V schedule's busiest rank may hold, as a share of 1F1B's (Qi et al.,
NeurIPS 2024: a half and a third of 1F1B's activations)."""
GOAL_DEVIATION = 0.15
"""The most a rank's measured peak may differ from the simulator's (relative)."""


def _table(raw: dict[int, dict[str, Any]]) -> Table:
    rows, goals = [], []
    for ranks, result in sorted(raw.items()):
        costs = ModelCosts(**{k: tuple(v) for k, v in result["costs"].items()})
        measured_by = {key: [rank_peaks[key] for rank_peaks in result["peaks"]]
                       for key in result["peaks"][0]}
        base = max(measured_by["1f1b never"])
        base_sim = max(simulated_mib(costs, Run("1f1b"), ranks) or [1.0])
        for configuration in runs(ranks):
            key = f"{configuration.schedule} {configuration.checkpoint}"
            measured = measured_by[key]
            simulated = simulated_mib(costs, configuration, ranks)
            deviation = (None if simulated is None else
                         max(abs(m / s - 1) for m, s in zip(measured, simulated)))
            name = f"P={ranks} {configuration.schedule} {configuration.checkpoint}"
            if configuration.schedule in GOAL_RATIO:
                goals.append(Goal.at_most(f"{name}: busiest rank / 1f1b's", max(measured) / base,
                                          GOAL_RATIO[configuration.schedule], unit="x"))
            if deviation is not None:
                goals.append(Goal.at_most(f"{name}: |measured / simulated - 1|", deviation,
                                          GOAL_DEVIATION, unit="%"))
            rows.append([
                ranks, configuration.schedule, configuration.checkpoint,
                ", ".join(f"{m:.0f}" for m in measured), round(max(measured), 1),
                round(max(measured) / base, 3),
                None if simulated is None else round(max(simulated), 1),
                None if simulated is None else round(max(simulated) / base_sim, 3),
                None if deviation is None else round(deviation, 3),
            ])
    return Table(
        title="Activation memory per rank: measured peak RSS growth of a step and the "
              "simulator's peak, per schedule and recomputation mode (GPT)",
        columns=["P", "schedule", "checkpoint", "measured per rank MiB",
                 "busiest rank MiB", "busiest / 1f1b (measured)", "simulated busiest MiB",
                 "busiest / 1f1b (simulated)", "worst measured / simulated - 1 (absolute)"],
        rows=rows,
        anchor="1f1b with every stage keeping its activations, measured in the same job",
        notes="Measured: each rank's resident-set growth over one step after two (weights, "
              "gradients, optimizer state and the step's messages included; the interpreter's "
              "and torch's own memory not). Simulated: each stage's saved bytes per "
              "micro-batch from the profiler, held from its forward to its last backward, "
              "plus the profiled temporary memory of the backward that runs. The V "
              "schedules' stages hold half a 1F1B stage each.",
        key="activation_memory", goals=goals)


def run(context: BenchContext) -> BenchResult:
    """Measure every configuration at each P (one job per P)."""
    spec, sizes = SIZES["quick" if context.quick else "full"]
    raw: dict[int, dict[str, Any]] = {}
    for ranks in sizes:
        context.progress(f"{ranks} ranks: {len(runs(ranks))} configurations")
        with temporary_environment(EXACT_MALLOC):
            raw[ranks] = run_job(worker, spec, world_size=ranks, timeout=1800)[0]
    return BenchResult(tables=[_table(raw)], data={"raw": {str(k): v for k, v in raw.items()},
                                                    "model": dataclasses.asdict(spec)})


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Per P, each rank's measured peak for every configuration, with the simulator's
    busiest rank beside: one PNG per P.

    Example::

        draw(tables, data, Path("results"))  # ['activation_memory_p2.png', ...]
    """
    from pipetrain.bench.plots import bar_chart

    drawn = []
    for ranks, result in sorted((data.get("raw") or {}).items(), key=lambda kv: int(kv[0])):
        costs = ModelCosts(**{k: tuple(v) for k, v in result["costs"].items()})
        measured = [f"{r.schedule} {r.checkpoint}" for r in runs(int(ranks))]
        series: dict[str, list[float | None]] = {
            f"rank {rank}": [peaks.get(key) for key in measured]
            for rank, peaks in enumerate(result["peaks"])}
        series["simulated, busiest rank"] = [
            None if (sim := simulated_mib(costs, r, int(ranks))) is None else max(sim)
            for r in runs(int(ranks))]
        drawn.append(bar_chart(out / f"activation_memory_p{ranks}.png",
                               title=f"Activation memory per rank, P = {ranks} (GPT): measured "
                                     "peak of a step, and the simulator's busiest rank",
                               categories=measured, series=series, ylabel="MiB"))
    return drawn


CASE = Case(name="activation_memory",
            title="Activation memory per rank: V-Half, V-Min, per-stage and selective "
                  "recomputation against 1F1B, measured and simulated",
            run=run, draw=draw, quick_seconds=15, full_seconds=370)
