"""Case ``schedules``: every schedule pipetrain has, head to head: bubble, throughput, activation memory.

The schedules (:data:`pipetrain.schedule.TRAINING_SCHEDULES`): ``gpipe``, ``1f1b``,
``interleaved-1f1b``, ``looped-bfs``, ``zb-h1``, ``zb-h2``, ``zb-v``, ``v-half``,
``v-min``, ``dualpipe-v`` (2 stages per rank for the interleaved, looped and V schedules) and the asynchronous
``pipedream`` and ``2bw`` (a step in their steady state), on two models: a memory-bound
MLP (16 x [Linear(1024, 1024) + GELU], SGD) and a compute-bound GPT (embedding, 14
blocks of width 128, head; AdamW), 16 layers each so that K = 8 ranks can hold 2 stages
each. M = 4K micro-batches per step (a micro-batch keeps its size at every K).

K = 2, measured: the case's 2-rank job (:mod:`._schedules_runs`) profiles every layer
(rank 0 alone), runs one ``Pipeline`` per (model, schedule) on the cut the simulator
gets, and times them round-robin: median step, bubble from the recorded actions.
K = 2, 4, 8, simulated (:mod:`._schedules_sim`): the simulator fed with those per-layer
costs. The table (:mod:`._schedules_table`) puts both side by side, with where they
disagree; the pictures show each schedule's throughput over the best one's at each K.
``--quick``: the MLP alone, 16 x [Linear(128, 128) + GELU], 3 repetitions.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case
from pipetrain.bench.cases._schedules_runs import ModelSpec, schedules_worker
from pipetrain.bench.cases._schedules_sim import SCHEDULES, ModelCosts, simulate_schedule
from pipetrain.bench.cases._schedules_table import draw_schedules, schedules_table
from pipetrain.bench.harness import foreign_load, load_line, run_job
from pipetrain.schedule import ASYNC_SCHEDULES

__all__ = ["CASE", "KS", "MICROBATCHES_PER_RANK", "SIZES", "Sizes", "analyse", "run"]

KS = (2, 4, 8)
"""Ranks: 2 measured (and simulated), 4 and 8 simulated."""
MICROBATCHES_PER_RANK = 4
"""M = 4K micro-batches per step."""

_MEASURED = ("median_s", "quartiles_s", "bubble_measured", "measured_makespan_s",
             "predicted_makespan_s", "gap", "num_stages")
"""What the table and data keep of each runner's analysed measurement."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The models and repetitions of one size of the case.

    Example:
        >>> SIZES["quick"].reps < SIZES["full"].reps
        True
    """

    specs: tuple[ModelSpec, ...]
    reps: int
    warmup: int
    profile_warmup: int
    profile_repetitions: int
    timeout_s: float


SIZES = {
    "full": Sizes(specs=(ModelSpec(name="MLP", kind="mlp", depth=16, width=1024,
                                   microbatch_size=8),
                         ModelSpec(name="GPT", kind="gpt", depth=16, width=128, heads=4,
                                   context=64, microbatch_size=2)),
                  reps=12, warmup=1, profile_warmup=2, profile_repetitions=5, timeout_s=900.0),
    "quick": Sizes(specs=(ModelSpec(name="MLP", kind="mlp", depth=16, width=128,
                                    microbatch_size=4),),
                   reps=3, warmup=0, profile_warmup=1, profile_repetitions=2, timeout_s=180.0),
}


def _loss_agreement(losses: dict[str, list[float]], specs: tuple[ModelSpec, ...]) -> str:
    """How far apart the synchronous schedules' first losses are, per model."""
    parts = []
    for spec in specs:
        runs = [v for s in SCHEDULES if s not in ASYNC_SCHEDULES
                and (v := losses.get(f"pipetrain:{spec.name} {s}")) is not None]
        if len(runs) > 1:
            spread = max(abs(a - b) for run in runs for a, b in zip(run, runs[0]))
            parts.append(f"{spec.name} {spread:.1e}")
    return ("First two losses of the synchronous schedules (same weights and batches), "
            f"largest difference: {', '.join(parts)}." if parts else "")


def analyse(raw: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """The results (JSON-ready) from what rank 0 returned: the measurements analysed
    (:func:`pipetrain.bench.vs_torch.analysis.runner_rows`) and every schedule simulated
    at every K with the profiled costs.

    Example::

        raw = run_job(schedules_worker, list(sizes.specs), settings, world_size=2)[0]
        table = schedules_table(analyse(raw, sizes))
    """
    from pipetrain.bench.vs_torch.analysis import runner_rows

    measured_m = MICROBATCHES_PER_RANK * 2
    rows = runner_rows(raw["runners"], raw["gathered"], lambda info: None, measured_m)
    models: dict[str, Any] = {}
    for spec in sizes.specs:
        costs = ModelCosts.from_dict(raw["profiles"][spec.name])
        per_k: dict[str, Any] = {}
        for k in KS:
            per_k[str(k)] = {}
            for schedule in SCHEDULES:
                sim = simulate_schedule(schedule, costs, num_ranks=k,
                                        num_microbatches=MICROBATCHES_PER_RANK * k)
                row = rows.get(f"{spec.name} {schedule}") if k == 2 else None
                per_k[str(k)][schedule] = {
                    "simulated": sim.to_dict(),
                    "measured": None if row is None else {
                        key: row[key] for key in _MEASURED if key in row}}
        models[spec.name] = {"microbatch_size": spec.microbatch_size,
                             "costs": dataclasses.asdict(costs), "k": per_k}
    failures = "; ".join(f"{label}: {why}" for label, why in raw["failures"].items())
    windows = [g["cpu_window"] for g in raw["gathered"]]
    return {"models": models,
            "settings": {"reps": sizes.reps, "warmup": sizes.warmup,
                         "microbatches_per_rank": MICROBATCHES_PER_RANK,
                         "profile_repetitions": sizes.profile_repetitions,
                         "specs": [dataclasses.asdict(s) for s in sizes.specs]},
            "losses": " ".join(filter(None, [
                _loss_agreement(raw["first_losses"], sizes.specs),
                f"Not measured: {failures}." if failures else ""])),
            "load": load_line(foreign_load(windows)) + ".",
            "balances_k2": raw["balances"], "first_losses": raw["first_losses"]}


def run(context: BenchContext) -> BenchResult:
    """Profile and time every schedule at K = 2, simulate K = 2, 4, 8; the table and
    one picture per model.

    Example::

        result = run(BenchContext(quick=True, out=Path("bench-out")))
        print(result.tables[0].markdown())
    """
    sizes = SIZES["quick" if context.quick else "full"]
    began = time.monotonic()
    context.progress(f"2 ranks: profile {', '.join(s.name for s in sizes.specs)}, then "
                     f"{sizes.reps} round-robin repetitions of "
                     f"{len(sizes.specs) * len(SCHEDULES)} Pipelines")
    settings = {"microbatches": MICROBATCHES_PER_RANK * 2, "reps": sizes.reps,
                "warmup": sizes.warmup, "profile_warmup": sizes.profile_warmup,
                "profile_repetitions": sizes.profile_repetitions}
    raw = run_job(schedules_worker, list(sizes.specs), settings, world_size=2, threads=1,
                  timeout=sizes.timeout_s)[0]
    context.progress(f"simulating K = {', '.join(str(k) for k in KS)}")
    data = analyse(raw, sizes)
    data["seconds"] = round(time.monotonic() - began, 1)
    tables = [schedules_table(data)]
    return BenchResult(tables=tables, data=data)


CASE = Case(name="schedules",
            title="Schedules head to head: bubble, throughput, activation memory (K = 2 "
                  "measured, K = 4, 8 simulated)",
            run=run, draw=draw_schedules, quick_seconds=12, full_seconds=160)
