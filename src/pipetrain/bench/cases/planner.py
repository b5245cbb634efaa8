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
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.drawings import bars, find_table, series
from pipetrain.bench.harness import median, run_job

__all__ = ["CASE", "GOAL_ERROR", "GOAL_SPEEDUP", "Options", "analyse", "draw", "run",
           "worker"]

GOAL_SPEEDUP = 1.3
"""The plan against the even split."""
GOAL_ERROR = 0.15
"""The plan's predicted step against its measured one."""
BANDWIDTH_BYTES = 16 * 2**20


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


def _model(opts: Options) -> Any:
    from pipetrain.models import GPTConfig

    return GPTConfig(vocab_size=opts.vocab, width=opts.width, num_layers=opts.layers,
                     context=opts.context, num_heads=opts.heads, tie_embeddings=False)


def _batch(opts: Options, step: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.context + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _measure_bandwidth(world_size: int) -> float:
    """Ring all-reduce bandwidth of the job, bytes per second (median of 5)."""
    import torch
    import torch.distributed as dist

    buffer = torch.ones(BANDWIDTH_BYTES // 4)
    times = []
    for k in range(6):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if k:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return 2 * (world_size - 1) / world_size * BANDWIDTH_BYTES / seconds


def _plan_on_rank0(opts: Options, world_size: int, measured_bandwidth: float) -> dict[str, Any]:
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.plan import PlannerConfig, Topology, make_plan, profile_model
    from pipetrain.plan.schedule_choice import plan_for_layout

    config = _model(opts)
    tokens, targets = _batch(opts, -1)
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
    return {"profile": profile.to_dict(), "plan": plan.to_dict(), "even": even_plan.to_dict(),
            "bandwidth": bandwidth, "profile_seconds": profiled, "plan_seconds": planned}


def worker(ctx: Any, opts: Options) -> dict[str, Any]:
    """Every rank: bandwidth, the plan (from rank 0), both layouts timed alternately."""
    import torch
    import torch.distributed as dist

    from pipetrain.api.pipeline import Pipeline
    from pipetrain.api.plan_config import config_from_plan
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.plan import Plan

    rank, world_size = dist.get_rank(), dist.get_world_size()
    measured_bandwidth = _measure_bandwidth(world_size)
    box: list[Any] = [_plan_on_rank0(opts, world_size, measured_bandwidth)
                      if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    planned = box[0]
    config = _model(opts)
    layouts = {name: config_from_plan(Plan.from_dict(planned[name]), num_layers=opts.layers + 2)
               for name in ("plan", "even")}

    def adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    pipes = {name: Pipeline(gpt_layer_factories(config, seed=0), loss_fn=gpt_loss,
                            optimizer=adamw, config=layout, context=ctx)
             for name, layout in layouts.items()}
    times: dict[str, list[float]] = {name: [] for name in pipes}
    records: dict[str, list[Any]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for k in range(opts.warmup + opts.repetitions):
        x, y = _batch(opts, k)
        for name, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            loss = pipe.train_step(x, y)
            elapsed = time.perf_counter() - start
            losses[name].append(loss)
            if k >= opts.warmup:
                times[name].append(elapsed)
                records[name].append((pipe.last_step_start, list(pipe.last_timeline)))
    schedules = {name: pipe.schedule() for name, pipe in pipes.items()}
    balances = {name: [len(r) for r in pipe.layout.layer_ranges] for name, pipe in pipes.items()}
    for pipe in pipes.values():
        pipe.close()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, {"times": times, "records": records})
    if rank != 0:
        return {}
    return {"planned": planned, "gathered": gathered, "losses": losses,
            "schedules": schedules, "balances": balances}


def _predicted(profile: Any, plan: Any, balance: Sequence[int], replicas: Sequence[int],
               bandwidth: float) -> dict[str, Any]:
    """The pipetrain model's step for a layout under the plan's choices, and its
    per-stage action costs."""
    from pipetrain.plan.costs_pipetrain import Candidate
    from pipetrain.plan.graph import CutGraph
    from pipetrain.plan.microbatch_profile import microbatch_profile
    from pipetrain.plan.simulated_step import predicted_step, step_costs

    total = plan.num_microbatches * plan.stages[0].replicas
    candidate = Candidate(schedule=plan.schedule, num_microbatches=total,
                          checkpoint=plan.checkpoint or "never")
    graph = CutGraph(microbatch_profile(profile, total))
    cuts = [0]
    for count in balance:
        cuts.append(cuts[-1] + count)
    loads = [graph.load(a, b) for a, b in itertools.pairwise(cuts)]
    costs = step_costs(loads, replicas, candidate, bandwidth=bandwidth)
    step = predicted_step(loads, replicas, candidate, bandwidth=bandwidth)
    return {"step_s": step, "costs": costs.per_stage(len(loads))}


def _measured(name: str, gathered: Sequence[Any], schedule: Any) -> dict[str, Any]:
    """Per-stage action costs measured in the timed steps, and the simulator on them."""
    from pipetrain.schedule import TimedAction, simulate
    from pipetrain.trace import aggregate, measure_step, offsets_from_origins

    world_size = len(gathered)
    measures, simulated = [], []
    for rep in range(len(gathered[0]["records"][name])):
        origins = [gathered[r]["records"][name][rep][0] for r in range(world_size)]
        offsets = offsets_from_origins(origins)
        timeline = [TimedAction(r, t.action, t.start + offsets[r], t.end + offsets[r])
                    for r in range(world_size) for t in gathered[r]["records"][name][rep][1]]
        measure = measure_step(timeline, num_ranks=world_size, num_stages=schedule.num_stages)
        measures.append(measure)
        simulated.append(simulate(schedule, measure.mean_costs).makespan)
    summary = aggregate(measures)
    return {"makespan_s": summary.makespan, "simulated_on_measured_s": median(simulated),
            "costs": summary.mean_costs.per_stage(schedule.num_stages)}


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Both layouts' measured and predicted steps, their costs, and the speedups."""
    from pipetrain.plan import Plan, Profile

    planned = raw["planned"]
    profile = Profile.from_dict(planned["profile"])
    gathered = raw["gathered"]
    out: dict[str, Any] = {"plan": planned["plan"], "even": planned["even"],
                           "bandwidth": planned["bandwidth"],
                           "profile_seconds": planned["profile_seconds"],
                           "plan_seconds": planned["plan_seconds"], "layouts": {}}
    for name in ("plan", "even"):
        plan = Plan.from_dict(planned[name])
        steps = [max(g["times"][name][k] for g in gathered)
                 for k in range(len(gathered[0]["times"][name]))]
        balance = raw["balances"][name]
        replicas = [s.replicas for s in plan.stages]
        predicted = _predicted(profile, plan, balance, replicas, planned["bandwidth"])
        measured = _measured(name, gathered, raw["schedules"][name])
        step = median(steps)
        out["layouts"][name] = {
            "balance": balance, "replicas": replicas, "step_s": step, "steps_s": steps,
            "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
            "checkpoint": plan.checkpoint,
            "predicted_s": predicted["step_s"],
            "error": predicted["step_s"] / step - 1.0,
            "makespan_s": measured["makespan_s"],
            "simulated_on_measured_s": measured["simulated_on_measured_s"],
            "profiled_costs": _costs(predicted["costs"]),
            "measured_costs": _costs(measured["costs"]),
            "first_losses": raw["losses"][name][:2],
        }
    out["speedup"] = out["layouts"]["even"]["step_s"] / out["layouts"]["plan"]["step_s"]
    out["predicted_speedup"] = (out["layouts"]["even"]["predicted_s"]
                                / out["layouts"]["plan"]["predicted_s"])
    return out


def _costs(costs: Any) -> dict[str, list[float]]:
    return {name: list(getattr(costs, name)) for name in
            ("forward", "backward", "backward_input", "backward_weight", "reduce", "step",
             "communication")}


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
    raw = run_job(worker, opts, world_size=opts.workers, timeout=opts.timeout)[0]
    result = analyse(raw)
    result["goals"] = {"speedup": result["speedup"] >= GOAL_SPEEDUP,
                       "prediction": abs(result["layouts"]["plan"]["error"]) <= GOAL_ERROR}
    result["options"] = asdict(opts)
    return BenchResult(tables=_tables(result, opts), data=result)


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


CASE = Case(name="planner", title="The planner's plan vs the even split, and its predicted step",
            run=run, draw=draw, quick_seconds=10, full_seconds=40)
