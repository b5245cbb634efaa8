"""The tables of case ``torchgpipe_paper``: the paper's speed-ups beside this run's, then
pipetrain.GPipe's and torchgpipe's throughput and peak memory per setting, then the
paper's memory tables.

A *record* is one measured setting (see :func:`pipetrain.bench.cases.torchgpipe_paper.measure`):
``model``, ``partitions``, ``chunks``, ``checkpoint`` and, by runner (``pipetrain``,
``torchgpipe``, ``plain``), ``samples_per_s`` and ``run_peak_mib``.

Example:
    >>> record = {"model": "unet", "partitions": 2, "chunks": 4, "checkpoint": "never",
    ...           "samples_per_s": {"pipetrain": 90.0, "torchgpipe": 60.0, "plain": 100.0},
    ...           "run_peak_mib": {"pipetrain": 30.0, "torchgpipe": 40.0, "plain": 20.0}}
    >>> speed = measured_tables([record], {"unet": "U-Net (2, 8)"})[1]
    >>> speed.rows[0][3:7]
    ['90.0', '60.0', '100.0', '1.50x']
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pipetrain.bench.case import Goal, Table
from pipetrain.bench.cases.torchgpipe_paper_figures import (
    AMOEBANET_SPEED,
    SOURCE,
    UNET_SPEED,
    paper_checkpoint,
    paper_tables,
)

__all__ = ["GOAL_MEMORY", "GOAL_SPEED", "measured_tables"]

_NAMES = {"amoebanet": "AmoebaNet-D", "unet": "U-Net"}
_SAME = ("the same model, weights, batch, balance, chunks and checkpoint mode; each runner "
         "in its own process (torchgpipe at its defaults, partitions on the CPU), steps "
         "interleaved, medians")
_SPEED_NOTES = (
    "In the paper every partition has a GPU of its own: more partitions bring more "
    "hardware, and micro-batches keep it busy, so the speed-up grows with n and m. Here "
    "every partition shares the same two CPU cores: partitions add no compute, so a "
    "pipeline cannot beat the plain model by much, and what is measured is the cost of "
    "pipelining itself (smaller micro-batches run less efficiently, 'always' and "
    "'except_last' recompute forward passes). That cost, the ordering of the checkpoint "
    "modes and each library's overhead at the same schedule carry over to GPUs; the "
    "speed-up over devices does not. torchgpipe runs all the partitions of one device on "
    "one thread; pipetrain runs each partition on its own thread, so two partitions can "
    "use the two cores at once.")
_MEMORY_NOTES = (
    "Peak RSS growth over the setting's first 3 training steps, from after the model was "
    "built, in a process of each runner's that takes no timed step, with glibc's mmap "
    "threshold fixed at 64 KiB (the resident set follows the live tensors: activations "
    "and gradients, not what the heap kept from an earlier setting). The paper measures instead the largest model each "
    "number of GPUs trains (its tables below): memory there grows with the devices, "
    "while here every partition shares one host's memory, so that scaling does not carry "
    "over. What does: re-materialization keeps only the partition-boundary activations "
    "('always' below 'except_last' below 'never'), and the two libraries' peaks at the "
    "same setting compare directly.")


def _load_note(records: list[dict[str, Any]], model: str) -> str:
    """The runners' threads, and how busy the machine was with other work while
    ``model``'s settings were timed."""
    mine = [r for r in records if r["model"] == model]
    threads = sorted({t for r in mine for t in r.get("torch_threads", {}).values() if t})
    note = (f" Each runner's process ran {'/'.join(map(str, threads))} intra-op "
            f"thread{'s' if threads != [1] else ''}." if threads else "")
    other = [r["load"]["other_cores"] for r in mine
             if r.get("load", {}).get("other_cores") is not None]
    if other:
        note += (f" While these settings were timed, other processes used {min(other):.1f} "
                 f"to {max(other):.1f} of the machine's {os.cpu_count()} cores on average: "
                 "with several intra-op threads (torch's default: one per core), a runner "
                 "waiting at an OpenMP barrier loses whole time slices to them, so figures "
                 "from a busy machine are not comparable.")
    return note + _anchor_note(mine)


def _anchor_note(records: list[dict[str, Any]]) -> str:
    """Which of torchgpipe's runs each row took, where it ran at two thread counts."""
    both = [r for r in records if len(r.get("torchgpipe_runs", {})) > 1]
    if not both:
        return ""
    one = sum(1 for r in both for run in r["torchgpipe_runs"].values()
              if run["chosen"] and run["torch_threads"] == 1)
    return (" torchgpipe ran each setting twice, at torch's default thread count and at one "
            "thread (its device thread and autograd's each start an OpenMP team, which contend "
            "on a small CPU), and each row shows its faster run: one thread in "
            f"{one} of {len(both)} rows. pipetrain ran at its defaults.")


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for record in records:
        if all(record[key] == value for key, value in match.items()):
            return record
    return None


def _amoebanet_vs_paper(records: list[dict[str, Any]], label: str) -> Table:
    rows = []
    base = _find(records, model="amoebanet", partitions=2, chunks=1, checkpoint="always")
    paper_base = AMOEBANET_SPEED[0][2]
    for n, m, rate, huang in AMOEBANET_SPEED:
        here = _find(records, model="amoebanet", partitions=n, chunks=m,
                     checkpoint=paper_checkpoint(m))
        cells = ["-", "-"]
        if here is not None and base is not None:
            cells = [_ratio(here["samples_per_s"][r], base["samples_per_s"][r])
                     for r in ("torchgpipe", "pipetrain")]
        rows.append([n, m, paper_checkpoint(m), f"{rate / paper_base:.2f}x", f"{huang:.2f}x",
                     *cells])
    return Table(
        key="amoebanet_vs_paper",
        title=f"AmoebaNet-D speed-up over n=2, m=1: the paper's and this CPU's ({label})",
        columns=["partitions n", "micro-batches m", "checkpoint", "paper: torchgpipe (P40s)",
                 "paper: Huang et al. (TPUs)", "here: torchgpipe", "here: pipetrain"],
        rows=rows,
        anchor=f"{SOURCE}; here: each library over its own n=2, m=1 run, {_SAME}",
        notes="'-': not measured here (up to 4 partitions, the chunk counts of this run). "
              + _SPEED_NOTES)


def _unet_vs_paper(records: list[dict[str, Any]], label: str) -> Table:
    rows: list[list[Any]] = [["baseline (plain)", 1, "1.00x", "-", "1.00x", "1.00x"]]
    plain_rate = UNET_SPEED[0][4]
    paper = {n: (m, rate) for _, n, m, _, rate in UNET_SPEED if n}
    measured = sorted({(r["partitions"], r["chunks"]) for r in records
                       if r["model"] == "unet"})
    for n in sorted(set(paper) | {k for k, _ in measured}):
        paper_m, paper_rate = paper.get(n, ("-", None))
        paper_cell = "-" if paper_rate is None else f"{paper_rate / plain_rate:.2f}x"
        here = [m for k, m in measured if k == n] or ["-"]
        for m in here:
            record = _find(records, model="unet", partitions=n, chunks=m,
                           checkpoint="except_last")
            cells = ["-", "-"] if record is None else [
                _ratio(record["samples_per_s"][r], record["samples_per_s"]["plain"])
                for r in ("torchgpipe", "pipetrain")]
            rows.append([f"pipeline-{n}", paper_m, paper_cell, m, *cells])
    return Table(
        key="unet_vs_paper",
        title=f"U-Net speed-up over the plain model: the paper's and this CPU's ({label})",
        columns=["experiment", "paper: micro-batches", "paper: torchgpipe (P40s)",
                 "here: micro-batches", "here: torchgpipe", "here: pipetrain"],
        rows=rows,
        anchor=f"{SOURCE}; here: checkpoint 'except_last' (torchgpipe's default, as in "
               f"the paper), over the plain model timed with it, {_SAME}",
        notes="The paper's baseline used a smaller batch (40) than its pipelines (80 to "
              "640); here the plain model trains the pipelines' batch. " + _SPEED_NOTES)


GOAL_SPEED = 1.0
"""pipetrain.GPipe's throughput over torchgpipe's, every setting, default options."""
GOAL_MEMORY = 1.03
"""pipetrain.GPipe's peak memory over torchgpipe's, every setting."""


def _goal(name: str, mine: float | None, theirs: float | None, *, memory: bool) -> Goal:
    ratio = None if mine is None or not theirs else mine / theirs
    if memory:
        return Goal.at_most(f"{name}: pipetrain / torchgpipe peak memory", ratio, GOAL_MEMORY,
                            unit="x")
    return Goal.at_least(f"{name}: pipetrain / torchgpipe throughput", ratio, GOAL_SPEED,
                         unit="x")


def _per_setting(records: list[dict[str, Any]], model: str, label: str, *, key: str,
                 title: str, unit: str, value: Callable[[dict[str, Any], str], Any],
                 ratio_columns: list[str], anchor: str, notes: str) -> Table:
    rows, goals = [], []
    for record in records:
        if record["model"] != model:
            continue
        figures = {r: value(record, r) for r in ("pipetrain", "torchgpipe", "plain")}
        goals.append(_goal(f"{_NAMES[model]} K={record['partitions']} m={record['chunks']} "
                           f"{record['checkpoint']}", figures["pipetrain"],
                           figures["torchgpipe"], memory=unit == "MiB"))
        shown = ["-" if v is None else f"{v:.1f}" for v in figures.values()]
        ratios = [_ratio(figures["pipetrain"], figures["torchgpipe"])]
        if len(ratio_columns) > 1:
            ratios += [_ratio(figures[r], figures["plain"]) for r in ("pipetrain", "torchgpipe")]
        rows.append([record["partitions"], record["chunks"], record["checkpoint"],
                     *shown, *ratios])
    return Table(key=key, title=f"{title}, {label}",
                 columns=["partitions K", "chunks m", "checkpoint", f"pipetrain {unit}",
                          f"torchgpipe {unit}", f"plain {unit}", *ratio_columns],
                 rows=rows, anchor=anchor, notes=notes, goals=goals)


def measured_tables(records: list[dict[str, Any]], workloads: dict[str, str]) -> list[Table]:
    """The case's tables: the paper comparisons, per model the measured speed and
    memory, and the paper's published tables."""
    tables = []
    if "amoebanet" in workloads:
        tables.append(_amoebanet_vs_paper(records, workloads["amoebanet"]))
    if "unet" in workloads:
        tables.append(_unet_vs_paper(records, workloads["unet"]))
    for model, label in workloads.items():
        tables.append(_per_setting(
            records, model, label, key=f"{model}_speed",
            title=f"{_NAMES[model]} training throughput, pipetrain.GPipe vs torchgpipe 0.0.7",
            unit="samples/s", value=lambda record, r: record["samples_per_s"][r],
            ratio_columns=["pipetrain / torchgpipe", "pipetrain / plain",
                           "torchgpipe / plain"],
            anchor=f"torchgpipe 0.0.7 and the plain nn.Sequential, {_SAME}",
            notes="Throughput ratios: above 1 means the first is faster. " + _SPEED_NOTES
                  + _load_note(records, model)))
        tables.append(_per_setting(
            records, model, label, key=f"{model}_memory",
            title=f"{_NAMES[model]} peak memory, pipetrain.GPipe vs torchgpipe 0.0.7",
            unit="MiB", value=lambda record, r: record["run_peak_mib"][r],
            ratio_columns=["pipetrain / torchgpipe"],
            anchor=f"torchgpipe 0.0.7 and the plain nn.Sequential, {_SAME}",
            notes="Memory ratio: below 1 means pipetrain needs less. " + _MEMORY_NOTES))
    return tables + paper_tables()
