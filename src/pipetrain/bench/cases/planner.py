"""Case ``planner``: the planner's plan vs the even split by layer count, trained side by
side; and the ``pipetrain`` cost model's predicted step vs the measured one.

A GPT with a large vocabulary (full size: 32,768 tokens, width 128, 8 blocks, context
32, 16 sequences per step, untied embedding and head, fused AdamW) is heavy at both ends
and thin in the middle: the token embedding's optimizer step and the output head's
matrix product and cross-entropy cost several blocks each, so cutting it by layer count
(the even split) leaves one stage much slower than the other. In one job of ``workers``
processes (gloo on 127.0.0.1, 1 intra-op thread each):

1. rank 0 profiles the model (:func:`pipetrain.plan.profile_model`, one batch of random
   tokens, its micro-batch times at one sample) while the other ranks wait;
2. the ranks measure the job's bandwidth (a gloo all-reduce of 16 MB: ring bandwidth
   ``2 (r - 1) / r * bytes / seconds``);
3. rank 0 plans with the ``pipetrain`` cost model on that many workers and bandwidth
   (stages, replicas, schedule, micro-batches, checkpoint mode; every worker used), and
   every rank takes the plan;
4. two pipelines are built in the same processes: the plan (``config_from_plan``) and
   the even split on as many stages as workers, with the schedule, micro-batches and
   checkpoint mode the same model finds best for that cut
   (:func:`~pipetrain.plan.schedule_choice.plan_for_layout`), so that each layout runs
   as well as the model knows how;
5. after warm-up steps, repetitions alternate between the two; each timed step starts
   after a barrier and lasts until the slowest rank returns from ``train_step``.

Reported: the medians, the speedup of the plan over the even split, the predicted step
of each layout (the simulator on the profiled costs, as the planner predicts it) against
the measured one, and where they part: the per-stage action costs measured in the timed
steps (``measure_step``) next to the profiled ones, and the simulator on the measured
costs. ``--quick``: a vocabulary of 16,384, 4 blocks, 3 timed steps per layout.

Then, in a second job: under a memory cap per worker, the planner's plan with a
re-materialization mode per stage against its best plan with one mode for every stage
(:mod:`pipetrain.bench.cases._planner_memory`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.cases._planner_memory import under_cap
from pipetrain.bench.cases._planner_runs import analyse, batch, gpt_config, worker
from pipetrain.bench.drawings import bars, find_table, series
from pipetrain.bench.harness import run_job

__all__ = ["CASE", "GOAL_ERROR", "GOAL_SPEEDUP", "Options", "draw", "run"]

GOAL_SPEEDUP = 1.3
"""The plan against the even split."""
GOAL_ERROR = 0.15
"""The plan's predicted step against its measured one."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """The model, the job and the repetitions."""

    workers: int = 2
    vocab: int = 32768
    width: int = 128
    layers: int = 8
    """Transformer blocks."""
    heads: int = 4
    context: int = 32
    batch: int = 16
    bandwidth: float | None = None
    """Bytes/s the planner assumes (``None``: measured in the job)."""
    schedules: tuple[str, ...] | None = None
    """The schedules the planner may choose (``None``: all it plans)."""
    repetitions: int = 10
    warmup: int = 3
    profile_repetitions: int = 5
    timeout: float = 900.0


FULL = Options()
QUICK = replace(FULL, vocab=16384, layers=4, repetitions=3, warmup=1, profile_repetitions=2)


def _plan_on_rank0(opts: Options, world_size: int, measured_bandwidth: float) -> dict[str, Any]:
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.plan import PlannerConfig, Topology, make_plan, profile_model
    from pipetrain.plan.schedule_choice import plan_for_layout

    config = gpt_config(opts)
    tokens, targets = batch(opts, -1)
    began = time.perf_counter()
    profile = profile_model(gpt_layer_factories(config, seed=0), tokens, loss_fn=gpt_loss,
                            target=targets, microbatch_size=1, device="cpu",
                            repetitions=opts.profile_repetitions)
    profiled = time.perf_counter() - began
    bandwidth = opts.bandwidth or measured_bandwidth
    began = time.perf_counter()
    planner = PlannerConfig(topology=Topology.flat(world_size, bandwidth),
                            schedules=opts.schedules)
    plan = make_plan(profile, planner)
    planned = time.perf_counter() - began
    layers = profile.num_layers
    even = [layers // world_size + (1 if j < layers % world_size else 0)
            for j in range(world_size)]
    even_plan = plan_for_layout(profile, even, [1] * world_size, planner)
    return {"names": ["plan", "even"], "profile": profile.to_dict(), "plan": plan.to_dict(),
            "even": even_plan.to_dict(), "bandwidth": bandwidth, "profile_seconds": profiled,
            "plan_seconds": planned}


def _tables(result: dict[str, Any], opts: Options) -> list[Table]:
    layouts = result["layouts"]
    main = Table(
        title=f"The planner's plan vs the even split: GPT vocabulary {opts.vocab}, width "
              f"{opts.width}, {opts.layers} blocks, context {opts.context}, batch {opts.batch}; "
              f"{opts.workers} workers x 1 thread, gloo",
        columns=["layout", "balance", "replicas", "schedule", "micro-batches", "checkpoint",
                 "measured ms", "predicted ms", "predicted / measured - 1",
                 "simulated on measured costs ms"],
        rows=[[name, str(e["balance"]), str(e["replicas"]), e["schedule"],
               e["num_microbatches"], e["checkpoint"], round(e["step_s"] * 1e3, 1),
               round(e["predicted_s"] * 1e3, 1), f"{e['error']:+.1%}",
               round(e["simulated_on_measured_s"] * 1e3, 1)] for name, e in layouts.items()]
        + [["speedup of the plan", "", "", "", "", "", f"{result['speedup']:.2f}x",
            f"{result['predicted_speedup']:.2f}x", "", ""]],
        anchor="the even split by layer count on as many stages as workers, with the "
               "schedule, micro-batches and checkpoint mode the cost model finds best for "
               "it, in the same processes, alternating step by step",
        notes=f"Goals: the plan at least {GOAL_SPEEDUP}x faster than the even split; its "
              f"predicted step within {GOAL_ERROR:.0%} of the measured one. Bandwidth "
              f"{result['bandwidth']:.3g} B/s (measured in the job); profiled in "
              f"{result['profile_seconds']:.1f} s, planned in {result['plan_seconds']:.2f} s.",
        key="plan_vs_even",
        goals=[Goal.at_least("plan / even split throughput", result["speedup"], GOAL_SPEEDUP,
                             unit="x"),
               Goal.at_most("plan: |predicted / measured - 1|",
                            abs(layouts["plan"]["error"]), GOAL_ERROR, unit="%")])
    rows = []
    for name, e in layouts.items():
        for kind in ("forward", "backward", "backward_input", "backward_weight", "reduce",
                     "step"):
            rows.append([name, kind,
                         ", ".join(f"{v * 1e3:.2f}" for v in e["profiled_costs"][kind]),
                         ", ".join(f"{v * 1e3:.2f}" for v in e["measured_costs"][kind])])
    costs = Table(title="Per-stage action costs (ms per stage): profiled vs measured in the "
                        "timed steps",
                  columns=["layout", "action", "profiled", "measured"], rows=rows,
                  anchor="the profile the planner used, against the actions recorded in the "
                         "same run's timed steps",
                  key="costs")
    return [main, costs]


def run(context: BenchContext) -> BenchResult:
    """Profile, plan, and train both layouts alternately in one job."""
    opts = QUICK if context.quick else FULL
    context.progress(f"{opts.workers} workers: profile, plan, then {opts.repetitions} timed "
                     "steps of each layout")
    raw = run_job(worker, opts, _plan_on_rank0, world_size=opts.workers, timeout=opts.timeout)[0]
    result = analyse(raw)
    result["goals"] = {"speedup": result["speedup"] >= GOAL_SPEEDUP,
                       "prediction": abs(result["layouts"]["plan"]["error"]) <= GOAL_ERROR}
    result["options"] = asdict(opts)
    capped_tables, result["under_cap"] = under_cap(context)
    return BenchResult(tables=_tables(result, opts) + capped_tables, data=result)


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """The step of the plan and of the even split, measured, predicted by the planner and
    simulated on the measured costs, with the plan's speed-up (measured and predicted) in
    the title: one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['planner_plan_vs_even.png']
    """
    table = find_table(tables, "plan_vs_even")
    if table is None:
        return []
    speedup = series(table, "layout", {"measured": "measured ms", "predicted": "predicted ms"},
                     where={"layout": "speedup of the plan"})[1]
    shown = [f"{name} {values[0]:.2f}x" for name, values in speedup.items()
             if values and values[0] is not None]
    return bars(out / "planner_plan_vs_even.png", table, "layout",
                {"measured": "measured ms", "predicted": "predicted ms",
                 "simulated on measured costs": "simulated on measured costs ms"},
                where={"layout": ("plan", "even")}, ylabel="ms per step",
                title="The planner's plan vs the even split: step time"
                      + (f" (speed-up of the plan: {', '.join(shown)})" if shown else ""))


CASE = Case(name="planner", title="The planner's plan vs the even split, its predicted step, "
                                  "and a mode per stage under a memory cap",
            run=run, draw=draw, quick_seconds=25, full_seconds=150)
