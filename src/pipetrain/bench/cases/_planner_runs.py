"""What the planner cases share: the GPT and its batches, the job's bandwidth, the worker
that trains the layouts rank 0 plans side by side, and the analysis of their steps
(measured, predicted by the planner, and simulated on the measured costs)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from pipetrain.bench.harness import median, ring_bandwidth

__all__ = ["analyse", "batch", "gpt_config", "worker"]

BANDWIDTH_BYTES = 16 * 2**20
_EXAMPLE = SimpleNamespace(vocab=16384, width=128, layers=4, heads=4, context=32, batch=16)


def gpt_config(opts: Any) -> Any:
    """The GPT of ``opts`` (vocab, width, layers, context, heads), embedding and head untied.

    Example:
        >>> gpt_config(_EXAMPLE).vocab_size, gpt_config(_EXAMPLE).tie_embeddings
        (16384, False)
    """
    from pipetrain.models import GPTConfig

    return GPTConfig(vocab_size=opts.vocab, width=opts.width, num_layers=opts.layers,
                     context=opts.context, num_heads=opts.heads, tie_embeddings=False)


def batch(opts: Any, step: int) -> tuple[Any, Any]:
    """Step ``step``'s random tokens and their next tokens, ``opts.batch`` sequences of
    ``opts.context`` (the same on every rank).

    Example:
        >>> tokens, targets = batch(_EXAMPLE, 0)
        >>> tuple(tokens.shape), bool((tokens[:, 1:] == targets[:, :-1]).all())
        ((16, 32), True)
    """
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.context + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def worker(ctx: Any, opts: Any, plan: Any) -> dict[str, Any]:
    """Every rank: bandwidth, the layouts rank 0 plans (``plan(opts, world_size,
    bandwidth)``: a dict naming them in ``names``, each a plan's dict, with the profile and
    the bandwidth used), all timed alternately, one step each in turn."""
    import torch
    import torch.distributed as dist

    from pipetrain.api.pipeline import Pipeline
    from pipetrain.api.plan_config import config_from_plan
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.plan import Plan

    rank, world_size = dist.get_rank(), dist.get_world_size()
    measured_bandwidth = ring_bandwidth(BANDWIDTH_BYTES, timed=5)
    box: list[Any] = [plan(opts, world_size, measured_bandwidth) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    planned = box[0]
    config = gpt_config(opts)
    layouts = {name: config_from_plan(Plan.from_dict(planned[name]), num_layers=opts.layers + 2)
               for name in planned["names"]}

    def adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    pipes = {name: Pipeline(gpt_layer_factories(config, seed=0), loss_fn=gpt_loss,
                            optimizer=adamw, config=layout, context=ctx)
             for name, layout in layouts.items()}
    times: dict[str, list[float]] = {name: [] for name in pipes}
    records: dict[str, list[Any]] = {name: [] for name in pipes}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    for k in range(opts.warmup + opts.repetitions):
        x, y = batch(opts, k)
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
    from pipetrain.plan.costs_pipetrain import PER_STAGE, Candidate
    from pipetrain.plan.graph import CutGraph
    from pipetrain.plan.microbatch_profile import microbatch_profile
    from pipetrain.plan.simulated_step import predicted_step, step_costs

    total = plan.num_microbatches * plan.stages[0].replicas
    modes = (plan.checkpoint or "never").split(",")
    candidate = Candidate(schedule=plan.schedule, num_microbatches=total,
                          checkpoint=modes[0] if len(modes) == 1 else PER_STAGE,
                          stage_checkpoints=tuple(modes) if len(modes) > 1 else None)
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
    """Every layout's measured and predicted steps and costs, and the speedup of the
    first named over the second, measured and predicted."""
    from pipetrain.plan import Plan, Profile

    planned = raw["planned"]
    profile = Profile.from_dict(planned["profile"])
    gathered = raw["gathered"]
    names = planned["names"]
    out: dict[str, Any] = {**{name: planned[name] for name in names},
                           "bandwidth": planned["bandwidth"],
                           "profile_seconds": planned["profile_seconds"],
                           "plan_seconds": planned["plan_seconds"], "layouts": {}}
    for name in names:
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
    first, second = (out["layouts"][name] for name in names[:2])
    out["speedup"] = second["step_s"] / first["step_s"]
    out["predicted_speedup"] = second["predicted_s"] / first["predicted_s"]
    return out


def _costs(costs: Any) -> dict[str, list[float]]:
    return {name: list(getattr(costs, name)) for name in
            ("forward", "backward", "backward_input", "backward_weight", "reduce", "step",
             "communication")}
