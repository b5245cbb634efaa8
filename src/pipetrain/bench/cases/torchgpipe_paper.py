"""Case ``torchgpipe_paper``: the torchgpipe paper's AmoebaNet-D and U-Net benchmarks at a
CPU size, pipetrain.GPipe beside torchgpipe 0.0.7's GPipe and the plain model.

The paper (Kim et al., 2020) measures the training throughput of AmoebaNet-D and U-Net
for several partition counts ``n`` and micro-batch counts ``m``, and the largest model
each setting trains. Here both models are cut into K = 1, 2 and 4 partitions, all on the
CPU, for a couple of chunk counts and every checkpoint mode (``always``,
``except_last``, ``never``); for each setting, pipetrain.GPipe, torchgpipe.GPipe (the
same model, weights, batch, balance, chunks and mode; its defaults otherwise, as its
users run it) and the plain ``nn.Sequential`` train in three processes of their own
(:mod:`.torchgpipe_paper_runs`), their outputs are checked equal, their steps timed
interleaved and their peak memory (RSS growth) measured. The tables give medians,
ratios and the paper's figures beside them (:mod:`.torchgpipe_paper_tables`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.cases.torchgpipe_paper_models import RUNNERS, Workload, profile_balance
from pipetrain.bench.cases.torchgpipe_paper_runs import ONE_THREAD, Runners, Setting, library
from pipetrain.bench.cases.torchgpipe_paper_tables import measured_tables
from pipetrain.bench.drawings import bars, find_table
from pipetrain.bench.gpipe_runs import MODES
from pipetrain.bench.harness import median, quartiles, spread_warnings

__all__ = ["CASE", "FULL", "MODES", "QUICK", "Plan", "draw", "measure", "run", "settings"]

_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures: the workloads, partition and chunk counts, checkpoint modes,
    and how many steps it times (``rounds * block`` per runner and setting, after
    ``warmup``). ``processes_per_group``: a fresh process per runner serves each (model,
    partitions, chunks) group, its checkpoint modes in turn; else one process per
    runner serves every setting (the quick run, where starting processes would take
    most of the time). ``threads``: each runner's intra-op threads (``None``: torch's
    default, what its users run; the quick run takes one, as a smoke run that stays
    quick on a busy machine, where several OpenMP threads per process stall each other).

    Example:
        >>> len(settings(QUICK, {"amoebanet": {2: [4, 5]}, "unet": {2: [5, 6]}}))
        6
    """

    workloads: dict[str, Workload]
    partitions: tuple[int, ...]
    chunks: dict[str, tuple[int, ...]]
    modes: tuple[str, ...] = MODES
    warmup: int = 2
    rounds: int = 3
    block: int = 3
    processes_per_group: bool = True
    threads: int | None = None
    anchor_one_thread: bool = True
    """torchgpipe also runs at one intra-op thread, and each setting takes its faster run
    (the anchor at its best: on a small CPU its device thread and autograd's each start an
    OpenMP team, which contend at torch's default thread count)."""


QUICK = Plan(
    workloads={"amoebanet": Workload(model="amoebanet", size=(3, 16), image=32, batch=16),
               "unet": Workload(model="unet", size=(2, 8), image=32, batch=16)},
    partitions=(2,), chunks={"amoebanet": (1,), "unet": (4,)},
    warmup=1, rounds=2, block=2, processes_per_group=False, threads=1, anchor_one_thread=False)
FULL = Plan(
    workloads={"amoebanet": Workload(model="amoebanet", size=(6, 32), image=64, batch=16),
               "unet": Workload(model="unet", size=(3, 8), image=64, batch=16)},
    partitions=(1, 2, 4), chunks={"amoebanet": (1, 4), "unet": (2, 4)})


def settings(plan: Plan, balances: dict[str, dict[int, list[int]]]) -> list[Setting]:
    """Every setting of ``plan``, grouped by (model, partitions, chunks), modes innermost.

    Example:
        >>> found = settings(QUICK, {"amoebanet": {2: [4, 5]}, "unet": {2: [5, 6]}})
        >>> [(s.workload.model, s.chunks, s.checkpoint) for s in found][:2]
        [('amoebanet', 1, 'never'), ('amoebanet', 1, 'except_last')]
    """
    return [Setting(workload=work, balance=tuple(balances[name][k]), chunks=m, checkpoint=mode)
            for name, work in plan.workloads.items() for k in plan.partitions
            for m in plan.chunks[name] for mode in plan.modes]


def _record(setting: Setting, setup: dict[str, Any], seconds: dict[str, list[float]],
            load: dict[str, Any], run_mib: dict[str, Any]) -> dict[str, Any]:
    """One setting's figures by runner; where torchgpipe also ran at one thread, its entry
    is the faster of its runs (``torchgpipe_runs`` keeps both)."""
    batch = setting.workload.batch
    medians = {name: median(times) for name, times in seconds.items()}
    variants = [name for name in medians if library(name) == "torchgpipe"]
    best = min(variants, key=lambda name: medians[name])
    runs = {name: {"samples_per_s": batch / medians[name], "run_peak_mib": run_mib[name],
                   "torch_threads": setup[name][1], "chosen": name == best}
            for name in variants}
    ran = {runner: best if runner == "torchgpipe" else runner for runner in RUNNERS}
    return {
        "model": setting.workload.model, "partitions": setting.num_partitions,
        "chunks": setting.chunks, "checkpoint": setting.checkpoint,
        "balance": list(setting.balance), "batch": batch,
        "median_step_s": {runner: medians[name] for runner, name in ran.items()},
        "quartiles_step_s": {runner: quartiles(seconds[name]) for runner, name in ran.items()},
        "step_s": {runner: seconds[name] for runner, name in ran.items()},
        "samples_per_s": {runner: batch / medians[name] for runner, name in ran.items()},
        "first_step_peak_mib": {runner: setup[name][0] for runner, name in ran.items()},
        "run_peak_mib": {runner: run_mib[name] for runner, name in ran.items()},
        "torch_threads": {runner: setup[name][1] for runner, name in ran.items()},
        "torchgpipe_runs": runs,
        "load": load,
    }


def measure(plan: Plan, progress: Callable[[str], None]
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every setting of ``plan``: one record per setting (and a progress line), and
    the balances used.

    Example::

        records, balances = measure(QUICK, print)
        records[0]["samples_per_s"]["pipetrain"]
    """
    balances = {name: profile_balance(work, list(plan.partitions))
                for name, work in plan.workloads.items()}
    records: list[dict[str, Any]] = []
    groups: dict[tuple[str, int, int], list[Setting]] = {}
    for setting in settings(plan, balances):
        key = (setting.workload.model, setting.num_partitions, setting.chunks)
        groups.setdefault(key if plan.processes_per_group else ("all", 0, 0), []).append(setting)
    for group in groups.values():
        extra = (f"torchgpipe{ONE_THREAD}",) if plan.anchor_one_thread else ()
        with Runners(timeout=_TIMEOUT_S, threads=plan.threads, extra=extra) as runners:
            for setting in group:
                setup = runners.setup(setting)
                seconds, load = runners.time(warmup=plan.warmup, rounds=plan.rounds,
                                             block=plan.block)
                record = _record(setting, setup, seconds, load, runners.peaks())
                records.append(record)
                progress(_line(record))
    return records, balances


def _line(record: dict[str, Any]) -> str:
    rate, mib = record["samples_per_s"], record["run_peak_mib"]
    memory = "" if mib["pipetrain"] is None else \
        f"; peak MiB pipetrain {mib['pipetrain']:.0f}, torchgpipe {mib['torchgpipe']:.0f}"
    other = record["load"]["other_cores"]
    load = "" if other is None else f"; other processes used {other:.1f} cores"
    return (f"{record['model']} K={record['partitions']} m={record['chunks']} "
            f"{record['checkpoint']}: samples/s pipetrain {rate['pipetrain']:.1f}, torchgpipe "
            f"{rate['torchgpipe']:.1f} ({rate['pipetrain'] / rate['torchgpipe']:.2f}x), plain "
            f"{rate['plain']:.1f}{memory}{load}")


def run(context: BenchContext) -> BenchResult:
    """Measure the plan of ``context`` (quick or full) and tabulate it."""
    plan = QUICK if context.quick else FULL
    started = time.perf_counter()
    records, balances = measure(plan, context.progress)
    workloads = {name: work.label for name, work in plan.workloads.items()}
    data = {
        "workloads": workloads,
        "balances": {name: {str(k): b for k, b in by_k.items()} for name, by_k in
                     balances.items()},
        "partitions": list(plan.partitions), "chunks": {k: list(v) for k, v in plan.chunks.items()},
        "timing": {"warmup": plan.warmup, "rounds": plan.rounds, "block": plan.block,
                   "threads": plan.threads or "torch's default",
                   "torchgpipe_also_at_one_thread": plan.anchor_one_thread,
                   "processes": "one per runner and (model, partitions, chunks)"
                   if plan.processes_per_group else "one per runner"},
        "records": records, "wall_s": time.perf_counter() - started,
    }
    samples = {f"{r['model']} K={r['partitions']} m={r['chunks']} {r['checkpoint']} {runner}":
               seconds for r in records for runner, seconds in r["step_s"].items()}
    return BenchResult(tables=measured_tables(records, workloads), data=data,
                       warnings=spread_warnings(samples))


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """The speed-ups of AmoebaNet-D and U-Net, the paper's beside this machine's
    (torchgpipe and pipetrain), and the peak memory of each model per setting and
    checkpoint mode: four PNGs.

    Example::

        draw(tables, data, Path("results"))  # ['torchgpipe_paper_amoebanet_speedup.png', ...]
    """
    here = {"here: torchgpipe": "here: torchgpipe", "here: pipetrain": "here: pipetrain"}
    names = bars(out / "torchgpipe_paper_amoebanet_speedup.png",
                 find_table(tables, "amoebanet_vs_paper"),
                 ["partitions n", "micro-batches m"],
                 {"paper: torchgpipe (P40s)": "paper: torchgpipe (P40s)",
                  "paper: Huang et al. (TPUs)": "paper: Huang et al. (TPUs)", **here},
                 form="n={}, m={}", title="AmoebaNet-D speed-up over n=2, m=1: the paper's "
                 "and this machine's", ylabel="speed-up", reference=1.0)
    names += bars(out / "torchgpipe_paper_unet_speedup.png",
                  find_table(tables, "unet_vs_paper"), "experiment",
                  {"paper: torchgpipe (P40s)": "paper: torchgpipe (P40s)", **here},
                  title="U-Net speed-up over the plain model: the paper's and this "
                        "machine's (micro-batches as in the table)",
                  ylabel="speed-up", reference=1.0)
    for model, label in (("amoebanet", "AmoebaNet-D"), ("unet", "U-Net")):
        names += bars(out / f"torchgpipe_paper_{model}_memory.png",
                      find_table(tables, f"{model}_memory"),
                      ["partitions K", "chunks m", "checkpoint"],
                      {f"{name} MiB": f"{name} MiB" for name in ("pipetrain", "torchgpipe",
                                                                 "plain")},
                      form="K={}, m={}, {}", title=f"{label} peak memory per setting and "
                      "checkpoint mode", ylabel="MiB")
    return names

CASE = Case(name="torchgpipe_paper",
            title="torchgpipe paper: AmoebaNet-D and U-Net, pipetrain.GPipe vs torchgpipe "
                  "0.0.7 per checkpoint mode",
            run=run, draw=draw, quick_seconds=20, full_seconds=1130, needs=("torchgpipe",))
