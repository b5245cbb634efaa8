"""Part 3, a compute-bound transformer: pipetrain vs torch.distributed.pipelining vs one process.

A GPT of ``blocks`` transformer blocks (pipetrain's ``models.gpt``: embedding, blocks,
final norm + head; untied, since torch's stages cannot share a weight), width ``width``,
``heads`` heads, sequence ``seq``, batch ``batch`` in ``microbatches`` micro-batches,
AdamW, next-byte cross-entropy on the default corpus; 2 ranks x 1 intra-op thread over
gloo. Side by side, interleaved: pipetrain's schedules (``tf_schedules``: every one by
default), torch's classes for each (the same cut, the same optimizer, at its fastest
settings: :data:`~pipetrain.bench.vs_torch.runners.TORCH_SETTINGS`), and the whole model
in ONE process on the full batch with 2 intra-op threads, as many as the pipeline's two
ranks have in all (rank 0; rank 1 idles), its gradients kept between steps too.

The yardstick (the *ideal*): each pipetrain schedule's own order run with plain autograd
in the same timed loop (:class:`~pipetrain.bench.vs_torch.plain.PlainOrder`: both ranks
computing, no communication), its per-stage costs simulated in each runner's order. Two
more columns take it apart: every layer's costs measured on a micro-batch in one process
alone (rank 0, rank 1 waiting), summed per stage (no contention between the ranks), and
the 2-stage costs measured with both ranks computing at once before the timed loop
(*contended*). ``tf_balance=None`` cuts the layers where the one-process 1F1B step is
shortest (both frameworks get the cut); schedules with 2 stages per rank get the 4-stage
cut that evens out forward + backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipetrain.bench.harness import foreign_load, gather_objects, median, step_times, summary
from pipetrain.bench.vs_torch.analysis import compare, runner_rows
from pipetrain.bench.vs_torch.costs import ideal, measure_costs, stage_costs_from_layers
from pipetrain.bench.vs_torch.options import Options
from pipetrain.bench.vs_torch.plain import (
    PlainOrder,
    beside_pipelines,
    gather_plain_costs,
    order_costs,
)
from pipetrain.bench.vs_torch.runners import (
    WORLD_SIZE,
    PipetrainRunner,
    TorchRunner,
    stage_ranges,
)
from pipetrain.bench.vs_torch.session import build_runners, first_losses, time_runners

__all__ = ["analyse_transformer", "transformer_worker"]

LR = 3e-4


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _config(opts: Options) -> Any:
    from pipetrain.models import GPTConfig

    return GPTConfig(num_layers=opts.tf_blocks, width=opts.tf_width, num_heads=opts.tf_heads,
                     context=opts.tf_seq, tie_embeddings=False)


def _layer_costs(factories: Sequence[Any], batches: Any, opts: Options) -> list[dict[str, float]]:
    """Every layer's costs on a micro-batch, in this process alone."""
    import torch

    from pipetrain.models import gpt_loss

    mb = opts.tf_batch // opts.tf_microbatches
    x, y = batches(0)
    x, y = x[:mb], y[:mb]
    hidden = torch.randn(mb, opts.tf_seq, opts.tf_width, generator=torch.Generator().manual_seed(0))
    costs = []
    for i, factory in enumerate(factories):
        first, last = i == 0, i == len(factories) - 1

        def batch(first: bool = first) -> tuple[Any, Any]:
            return x if first else hidden.clone().requires_grad_(True), y

        costs.append(measure_costs(
            factory(), batch,
            loss_fn=gpt_loss if last else None, optimizer=_adamw,
            microbatches=opts.tf_microbatches, rounds=opts.tf_cost_rounds))
    return costs


def _stage_costs(factories: Sequence[Any], ranges: Sequence[range], batches: Any,
                 opts: Options) -> dict[str, float]:
    """This rank's stage's costs (its layers as one module), both ranks at once."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipetrain.models import gpt_loss

    j = dist.get_rank()
    mb = opts.tf_batch // opts.tf_microbatches
    x, y = batches(0)
    x, y = x[:mb], y[:mb]
    hidden = torch.randn(mb, opts.tf_seq, opts.tf_width, generator=torch.Generator().manual_seed(0))
    module = nn.Sequential(*(factories[i]() for i in ranges[j]))
    last = j == len(ranges) - 1
    return measure_costs(
        module, lambda: (x if j == 0 else hidden.clone().requires_grad_(True), y),
        loss_fn=gpt_loss if last else None, optimizer=_adamw,
        microbatches=opts.tf_microbatches, rounds=opts.tf_cost_rounds)


def _balances(layers: Sequence[dict[str, float]], opts: Options) -> dict[int, list[int]]:
    """The cut of each stage count: 2 stages where the ideal 1F1B step is shortest (or
    ``tf_balance``), 4 stages (2 per rank) evening out forward + backward per stage."""
    from pipetrain.partition import solve

    two = (_best_balance(layers, opts.tf_microbatches) if opts.tf_balance is None
           else list(opts.tf_balance))
    work = [layer["forward"] + layer["backward"] for layer in layers]
    return {2: two, 4: list(solve(work, 4))}


def _best_balance(layers: Sequence[dict[str, float]], microbatches: int) -> list[int]:
    """The 2-stage cut whose ideal 1F1B step is shortest."""
    from pipetrain.schedule import build_schedule

    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=microbatches,
                              optimizer_step=True, reduce=True)
    n = len(layers)
    best = min(range(1, n), key=lambda k: ideal(
        schedule, stage_costs_from_layers(layers, stage_ranges(n, 2, [k, n - k])))["ideal_s"])
    return [best, n - best]


def _single_isolated(factories: Sequence[Any], batches: Any, opts: Options) -> float:
    """The median full-batch step of the whole model in this process alone."""
    import time

    single = _Single(factories)
    times = []
    for k in range(opts.tf_cost_rounds + 2):
        start = time.perf_counter()
        single.step(*batches(k))
        if k >= 1:  # the first warms up
            times.append(time.perf_counter() - start)
    return median(times)


class _Single:
    """The whole model in this process, the full batch at once (rank 0 only), with
    ``threads`` intra-op threads during its step (as many as the pipeline's ranks have in
    all) and its gradients kept between steps."""

    label = "single"
    framework = "single"
    ranks = (0,)

    def __init__(self, factories: Sequence[Any], *, threads: int = 1) -> None:
        from torch import nn

        self.model = nn.Sequential(*(f() for f in factories))
        self.optimizer = _adamw(self.model.parameters())
        self.threads = threads

    def step(self, x: Any, y: Any) -> float:
        import torch

        from pipetrain.models import gpt_loss

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            loss = gpt_loss(self.model(x), y)
            torch.autograd.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        finally:
            torch.set_num_threads(before)
        return float(loss.item())


class _Absent:
    label = "single"
    framework = "single"
    ranks = (0,)

    def step(self, x: Any, y: Any) -> None:  # never called on this rank
        raise AssertionError("the single-process step runs on rank 0 only")


def transformer_worker(ctx: Any, opts: Options) -> dict[str, Any]:
    """Every rank: costs, balance, runners, first losses, interleaved timing."""
    import torch.distributed as dist

    from pipetrain.data import TextDataset, load_corpus
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.schedule import default_stages_per_rank

    rank = dist.get_rank()
    config = _config(opts)
    factories = gpt_layer_factories(config, seed=0)
    dataset = TextDataset(load_corpus(max_bytes=2_000_000), context=config.context, seed=0)

    def batches(k: int) -> tuple[Any, Any]:
        return dataset.batch(k, opts.tf_batch)

    isolated = ((_layer_costs(factories, batches, opts), _single_isolated(factories, batches, opts))
                if rank == 0 else None)
    dist.barrier()
    layers, single_isolated = gather_objects(isolated)[0]
    balances = _balances(layers, opts)
    balance = balances[2]
    ranges = stage_ranges(len(factories), 2, balance)
    dist.barrier()
    contended = gather_objects(_stage_costs(factories, ranges, batches, opts))

    M = opts.tf_microbatches
    def cut(schedule: str) -> list[int]:
        return balances[WORLD_SIZE * default_stages_per_rank(schedule)]

    runners, failures = build_runners(
        opts.tf_schedules,
        lambda schedule: PipetrainRunner(ctx, schedule, factories, microbatches=M,
                                         loss_fn=gpt_loss, optimizer=_adamw,
                                         balance=cut(schedule)),
        lambda schedule, variant: TorchRunner(ctx, schedule, variant, factories, microbatches=M,
                                              loss_fn=gpt_loss, optimizer=_adamw,
                                              balance=balances[WORLD_SIZE * variant[2]],
                                              trace=opts.trace_torch,
                                              timeout=opts.torch_timeout))
    losses = first_losses(runners, batches, failures)
    single: Any = _Single(factories, threads=WORLD_SIZE) if rank == 0 else _Absent()
    if rank == 0:
        losses["single"] = [single.step(*batches(k)) for k in range(2)]
    timed, plains = beside_pipelines(runners, lambda r: PlainOrder(
        r.pipe.schedule(M), factories, rank=rank, loss_fn=gpt_loss, optimizer=_adamw,
        example=batches(0)[0], balance=cut(r.schedule_name)))
    gathered, info = time_runners([*timed, single], batches, reps=opts.tf_reps,
                                  warmup=opts.tf_warmup, microbatches=M)
    plain = gather_plain_costs(plains)
    if rank != 0:
        return {}
    return {"runners": info, "gathered": gathered, "failures": failures, "first_losses": losses,
            "layer_costs": layers, "balance": balance, "balances": balances,
            "contended": contended, "plain": plain,
            "single_isolated_s": single_isolated}


def analyse_transformer(raw: dict[str, Any], opts: Options) -> dict[str, Any]:
    """Ratios, speedups and the gap between each step and its ideal (in the parent)."""
    balance = raw["balance"]
    n = sum(balance)
    ranges = stage_ranges(n, 2, balance)
    one_process = stage_costs_from_layers(raw["layer_costs"], ranges)
    balances = {int(k): v for k, v in raw.get("balances", {2: balance}).items()}
    isolated = {k: stage_costs_from_layers(raw["layer_costs"], stage_ranges(n, k, cut))
                for k, cut in balances.items()}
    contended = {name: [raw["contended"][j][name] for j in range(2)]
                 for name in ("forward", "backward", "step")}
    gathered = raw["gathered"]
    runners = {label: info for label, info in raw["runners"].items()
               if label != "single" and info["framework"] != "plain"}
    plain = raw["plain"]
    rows = runner_rows(
        runners, gathered,
        lambda info: order_costs(plain, info["schedule"], info["stage_to_rank"]),
        opts.tf_microbatches,
        other_ideals={"ideal_one_process_s": lambda info: isolated.get(info["num_stages"]),
                      "ideal_contended_s": lambda info: {2: contended}.get(info["num_stages"])})
    single_times = step_times([g["samples"] for g in gathered], "single")
    single = {**summary(single_times), "threads": WORLD_SIZE}
    losses = raw["first_losses"]
    reference = losses.pop("single", None)
    per_schedule = compare(rows, opts.tf_schedules, raw["failures"], losses, reference)
    M = opts.tf_microbatches
    # one process on micro-batches: every layer's forward + backward M times, one step
    microbatched = M * (sum(one_process["forward"]) + sum(one_process["backward"])) + sum(
        one_process["step"])
    for entry in per_schedule.values():
        ours = entry.get("pipetrain")
        if ours is None:
            continue
        ours["speedup_vs_single"] = single["median_s"] / ours["median_s"]
        if "ideal_s" in ours:
            ours["ideal_speedup_vs_single"] = single["median_s"] / ours["ideal_s"]
            ours["ideal_speedup_microbatched"] = microbatched / ours["ideal_s"]
        for row in entry["torch"].values():
            row["speedup_vs_single"] = single["median_s"] / row["median_s"]
    # what stands between one process and the ideal pipeline, from isolated costs only
    breakdown = {
        "single_full_batch_s": raw["single_isolated_s"],
        "single_microbatched_s": microbatched,
        "microbatch_efficiency_loss": microbatched / raw["single_isolated_s"] - 1.0,
        "half_of_microbatched_s": microbatched / 2,
        "ideal_1f1b_s": per_schedule.get("1f1b", {}).get("pipetrain", {}).get("ideal_s"),
        "ideal_gpipe_s": per_schedule.get("gpipe", {}).get("pipetrain", {}).get("ideal_s"),
        "stage_work_s": [M * (f + b) + st for f, b, st in zip(
            one_process["forward"], one_process["backward"], one_process["step"])],
    }
    return {
        "breakdown": breakdown,
        "model": {"blocks": opts.tf_blocks, "width": opts.tf_width, "heads": opts.tf_heads,
                  "seq": opts.tf_seq, "batch": opts.tf_batch, "microbatches": M,
                  "balance": balance, "balances": {str(k): v for k, v in balances.items()}},
        "schedules": per_schedule,
        "single": single,
        "single_microbatched_ideal_s": microbatched,
        "layer_costs_s": raw["layer_costs"],
        "stage_costs_one_process_s": one_process,
        "stage_costs_contended_s": contended,
        "plain_costs_s": plain,
        "load_during_timing": foreign_load([g["cpu_window"] for g in gathered]),
        "median_single_s": median(single_times),
        "single_step_s": single_times,
    }
