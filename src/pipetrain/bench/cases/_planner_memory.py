"""Part of case ``planner``: under a memory cap per worker, the planner's plan with a
re-materialization mode per stage against the best plan with one mode for every stage,
trained side by side.

In 1F1B stage ``j`` of ``P`` keeps ``P - j`` micro-batches of activations, so under a cap
the first stages run out of memory first; recomputing on every stage (the only remedy
most tools offer) also slows the stages that had room. A GPT (embedding, 8 blocks of
width 256, untied head over 8,192 tokens; 16 sequences of 256 tokens per step, AdamW) on
``P = 4`` straight stages, in one job of 4 processes (gloo on 127.0.0.1, one intra-op
thread each; the machine has 2 cores):

1. rank 0 profiles the model (:func:`pipetrain.plan.profile_model`, one sample per
   micro-batch); the cap is halfway between the least memory per worker any plan
   without recomputation needs (one worker per stage, any cut, schedule and
   micro-batches) and the least a plan with a mode per stage needs, so that no plan
   keeping every activation fits;
2. under that cap, the planner's plan (``checkpoints``: every mode and ``per-stage``)
   and, for each of ``never``, ``except_last``, ``always`` and ``per_layer`` alone
   (:data:`~pipetrain.plan.checkpoint_costs.CHECKPOINT_MODES`), the planner's best
   plan with that mode on every stage; the fastest predicted of those is the anchor
   (each chooses its own cut, schedule and micro-batches);
3. both plans are built in the same processes and timed alternately after warm-up
   steps, each timed step from a barrier until the slowest rank returns from
   ``train_step`` (:func:`pipetrain.bench.cases._planner_runs.worker`).

Reported: the cap, each plan's choices, its predicted memory per worker and step, the
measured step, and the speedup of the per-stage plan, measured and predicted; the modes
with one mode for all that found no plan under the cap. ``--quick``: 6 blocks of width
96 over 1,024 tokens, context 128, 2 timed steps.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from pipetrain.bench.case import BenchContext, Goal, Table
from pipetrain.bench.cases._planner_runs import analyse, batch, gpt_config, worker
from pipetrain.bench.harness import run_job
from pipetrain.bench.harness.machine import usable_cores
from pipetrain.plan.checkpoint_costs import CHECKPOINT_MODES

__all__ = ["GOAL_SPEEDUP", "Options", "cap_between", "under_cap"]

GOAL_SPEEDUP = 1.2
"""The per-stage plan against the best plan with one mode for every stage."""

_MIB = float(1 << 20)
_UNIFORM = CHECKPOINT_MODES


@dataclass(frozen=True, kw_only=True)
class Options:
    """The model, the job and the repetitions (the fields :mod:`planner`'s worker reads)."""

    workers: int = 4
    vocab: int = 8192
    width: int = 256
    layers: int = 8
    heads: int = 4
    context: int = 256
    batch: int = 16
    bandwidth: float | None = None
    repetitions: int = 7
    warmup: int = 2
    profile_repetitions: int = 3
    timeout: float = 1500.0


FULL = Options()
QUICK = replace(FULL, vocab=1024, width=96, layers=6, context=128, repetitions=2, warmup=1,
                profile_repetitions=1, timeout=600.0)


def cap_between(lowest: float, without: float) -> float:
    """The cap: halfway between the least a plan with a mode per stage needs and the least
    a plan without recomputation needs (bytes per worker).

    Example:
        >>> cap_between(60e6, 100e6)
        80000000.0
    """
    return (lowest + without) / 2


def _smallest(fits: Any, low: float, high: float) -> float:
    """The smallest cap in ``(low, high]`` (within 0.5%) under which ``fits(cap)``,
    ``fits(high)`` being true."""
    while high / low > 1.005:
        middle = (low * high) ** 0.5
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def _plan_under_cap(opts: Options, world_size: int, measured_bandwidth: float) -> dict[str, Any]:
    """Rank 0: profile, the cap, the per-stage plan and the best plan with one mode."""
    import time

    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.plan import PlannerConfig, Topology, make_plan, profile_model

    tokens, targets = batch(opts, -1)
    began = time.perf_counter()
    profile = profile_model(gpt_layer_factories(gpt_config(opts), seed=0), tokens,
                            loss_fn=gpt_loss, target=targets, microbatch_size=1, device="cpu",
                            repetitions=opts.profile_repetitions)
    profiled = time.perf_counter() - began
    bandwidth = opts.bandwidth or measured_bandwidth
    base = PlannerConfig(topology=Topology.flat(world_size, bandwidth), straight=True)

    def plan(cap: float | None, modes: tuple[str, ...] | None) -> Any:
        try:
            return make_plan(profile, replace(base, memory_limit=cap, checkpoints=modes))
        except ValueError:
            return None

    began = time.perf_counter()
    free = make_plan(profile, base)
    uncapped = max(s.memory_per_worker or 0.0 for s in free.stages)
    lowest = _smallest(lambda cap: plan(cap, ("per-stage",)) is not None,
                       uncapped / 16, uncapped)
    without = _smallest(lambda cap: plan(cap, ("never",)) is not None, lowest, uncapped)
    cap = cap_between(lowest, without)
    chosen = plan(cap, None)
    uniform = {mode: plan(cap, (mode,)) for mode in _UNIFORM}
    fitting = {mode: p for mode, p in uniform.items() if p is not None}
    if chosen is None or not fitting:
        raise RuntimeError(f"no plan under the cap of {cap / _MIB:.1f} MiB per worker: "
                           f"per-stage {chosen is not None}, one mode {sorted(fitting)}")
    anchor = min(fitting.values(), key=lambda p: p.time_per_step)
    planned = time.perf_counter() - began
    return {"names": ["per-stage", "one mode"], "profile": profile.to_dict(),
            "per-stage": chosen.to_dict(), "one mode": anchor.to_dict(),
            "uncapped": free.to_dict(), "cap": cap, "lowest": lowest, "without": without,
            "uniform_steps": {mode: (p.time_per_step if p is not None else None)
                              for mode, p in uniform.items()},
            "bandwidth": bandwidth, "profile_seconds": profiled, "plan_seconds": planned}


def _tables(result: dict[str, Any], opts: Options) -> list[Table]:
    layouts, cap = result["layouts"], result["cap"]
    peaks = {name: max(s["memory_per_worker"] for s in result[name]["stages"]) / _MIB
             for name in layouts}
    rows = [[name, str(e["balance"]), e["schedule"], e["num_microbatches"], e["checkpoint"],
             round(peaks[name], 1), round(e["step_s"] * 1e3, 1), round(e["predicted_s"] * 1e3, 1),
             f"{e['error']:+.1%}"] for name, e in layouts.items()]
    rows.append(["speedup of the per-stage plan", "", "", "", "", "",
                 f"{result['speedup']:.2f}x", f"{result['predicted_speedup']:.2f}x", ""])
    steps = result["uniform_steps"]
    one_mode = ", ".join(f"{mode} {steps[mode] * 1e3:.0f} ms" if steps[mode] is not None
                         else f"{mode} none fits" for mode in _UNIFORM)
    uncapped = max(s["memory_per_worker"] for s in result["uncapped"]["stages"]) / _MIB
    cores = usable_cores() or os.cpu_count()
    shared = (f"The {opts.workers} processes share the machine's {cores} cores: a measured "
              "step also counts the work of stages waiting for a core, where the prediction "
              "gives each stage a core of its own. " if cores and cores < opts.workers else "")
    main = Table(
        title=f"Under a cap of {cap / _MIB:.1f} MiB per worker: a mode per stage vs one mode for "
              f"all; GPT vocabulary {opts.vocab}, width {opts.width}, {opts.layers} blocks, "
              f"context {opts.context}, batch {opts.batch}; {opts.workers} straight stages, "
              f"1 thread each, gloo",
        columns=["plan", "balance", "schedule", "micro-batches", "checkpoint",
                 "predicted MiB per worker", "measured ms", "predicted ms",
                 "predicted / measured - 1"],
        rows=rows,
        anchor="the planner's fastest plan with one checkpoint mode on every stage under the "
               "same cap (each mode planned alone, with its own cut, schedule and "
               "micro-batches), in the same processes, alternating step by step",
        notes=f"The cap is halfway between the least a plan with a mode per stage needs "
              f"({result['lowest'] / _MIB:.1f} MiB) and the least any plan without "
              f"recomputation needs ({result['without'] / _MIB:.1f} MiB; the plan made "
              f"without a cap needs {uncapped:.1f} MiB), so that no plan keeping every "
              f"activation fits. Predicted steps with one mode for all: "
              f"{one_mode}. Goal: the per-stage plan at least {GOAL_SPEEDUP}x faster, measured. "
              f"{shared}Profiled in "
              f"{result['profile_seconds']:.1f} s, planned in {result['plan_seconds']:.1f} s.",
        key="per_stage_vs_one_mode",
        goals=[Goal.at_least("per-stage plan / one-mode plan throughput", result["speedup"],
                             GOAL_SPEEDUP, unit="x")])
    return [main]


def under_cap(context: BenchContext) -> tuple[list[Table], dict[str, Any]]:
    """Profile, find the cap, plan both ways, and train both plans alternately: the
    table and the data.

    Example::

        tables, data = under_cap(context)  # data["speedup"]: per-stage over one mode
    """
    opts = QUICK if context.quick else FULL
    context.progress(f"{opts.workers} workers: profile, plan under a memory cap, then "
                     f"{opts.repetitions} timed steps of each plan")
    raw = run_job(worker, opts, _plan_under_cap, world_size=opts.workers,
                  timeout=opts.timeout)[0]
    result = analyse(raw)
    for key in ("cap", "lowest", "without", "uncapped", "uniform_steps"):
        result[key] = raw["planned"][key]
    result["goals"] = {"speedup": result["speedup"] >= GOAL_SPEEDUP}
    result["options"] = asdict(opts)
    return _tables(result, opts), result
