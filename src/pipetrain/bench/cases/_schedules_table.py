"""Case ``schedules``' table and pictures, from its results (measured K = 2, simulated K = 2, 4, 8).

The results are JSON-ready (as a result file holds them): per model, its micro-batch
size, per-layer costs, and per K and schedule the simulation
(:meth:`~pipetrain.bench.cases._schedules_sim.Simulated.to_dict`) and, at K = 2, the
measurement (median step, measured bubble, the action span and its simulation from the
costs measured in the step). :func:`schedules_table` makes the table (one row per model,
K and schedule), :func:`draw_schedules` the pictures (one per model).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipetrain.bench.case import Table
from pipetrain.bench.harness import pct
from pipetrain.bench.plots import bar_chart

__all__ = ["COLUMNS", "draw_schedules", "relative_throughput", "schedules_table"]

COLUMNS = ["model", "K", "schedule", "measured ms", "simulated ms", "measured vs simulated",
           "samples/s", "throughput vs best", "bubble measured", "bubble simulated",
           "peak micro-batches held", "peak activations MiB", "weight versions"]

_MIB = float(1 << 20)


def relative_throughput(steps: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each schedule's throughput over the best one's (steps of the same work, seconds).

    Example:
        >>> relative_throughput({"gpipe": 2.0, "1f1b": 1.0, "zb-h1": None})
        {'gpipe': 0.5, '1f1b': 1.0, 'zb-h1': None}
    """
    best = min((s for s in steps.values() if s), default=None)
    return {name: None if not s or best is None else best / s for name, s in steps.items()}


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 2)


def _rows(model: str, entry: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for k_text, per_schedule in entry["k"].items():
        k = int(k_text)
        measured = {s: (e.get("measured") or {}).get("median_s") for s, e in per_schedule.items()}
        basis = measured if k == 2 else {s: e["simulated"]["makespan_s"]
                                         for s, e in per_schedule.items()}
        relative = relative_throughput(basis)
        for schedule, e in per_schedule.items():
            sim, real = e["simulated"], e.get("measured") or {}
            step, share = basis[schedule], relative[schedule]
            samples = entry["microbatch_size"] * sim["num_microbatches"]
            rows.append([
                model, k, schedule, _ms(real.get("median_s")), _ms(sim["makespan_s"]),
                pct(real["median_s"] / sim["makespan_s"] - 1.0) if real else "-",
                None if not step else round(samples / step, 1),
                None if share is None else round(share, 3),
                _share(real.get("bubble_measured")), _share(sim["bubble"]), sim["peak_held"],
                round(sim["peak_bytes"] / _MIB, 3), sim["weight_versions"]])
    return rows


def _shape(spec: Mapping[str, Any]) -> str:
    """A model of the case in words (``spec``: a ModelSpec as a dict)."""
    if spec["kind"] == "mlp":
        return (f"{spec['depth']} x [Linear({spec['width']}, {spec['width']}) + GELU], MSE, "
                "SGD")
    return (f"embedding, {spec['depth'] - 2} blocks of width {spec['width']} "
            f"({spec['heads']} heads, context {spec['context']}), head; AdamW")


def _costs_line(model: str, entry: Mapping[str, Any], spec: Mapping[str, Any] | None) -> str:
    c = entry["costs"]
    total = {name: 1e3 * sum(c[name]) for name in ("forward", "backward", "backward_input",
                                                   "backward_weight", "step")}
    shape = f" ({_shape(spec)})" if spec else ""
    return (f"{model}{shape}, one micro-batch of {entry['microbatch_size']}: forward {total['forward']:.3g} ms, backward "
            f"{total['backward']:.3g} ms (input {total['backward_input']:.3g} + weight "
            f"{total['backward_weight']:.3g}), optimizer step {total['step']:.3g} ms, "
            f"activations {sum(c['activation_bytes']) / _MIB:.3g} MiB")


def _gaps(results: Mapping[str, Any]) -> str:
    """Where the K = 2 measurements and the simulation from profiled costs disagree."""
    parts = []
    for model, entry in results["models"].items():
        gaps = {s: e["measured"]["median_s"] / e["simulated"]["makespan_s"] - 1.0
                for s, e in entry["k"]["2"].items() if e.get("measured")}
        in_step = [e["measured"]["gap"] for e in entry["k"]["2"].values()
                   if e.get("measured") and e["measured"].get("gap") is not None]
        if not gaps:
            parts.append(f"{model}: nothing measured")
            continue
        worst = sorted(gaps, key=lambda s: -abs(gaps[s]))[:2]
        parts.append(
            f"{model}: measured steps {pct(min(gaps.values()))} to {pct(max(gaps.values()))} "
            f"against the simulation from profiled costs (median "
            f"{pct(statistics.median(gaps.values()))}; furthest "
            f"{', '.join(f'{s} {pct(gaps[s])}' for s in worst)})"
            + (f", the recorded actions within {pct(statistics.median(in_step))} (median) of "
               "the simulation from the costs measured in the same steps" if in_step else ""))
    return "; ".join(parts)


def schedules_table(results: Mapping[str, Any]) -> Table:
    """The case's table: per model, K and schedule, measured (K = 2) and simulated figures.

    Example:
        >>> sim = {"makespan_s": 0.01, "bubble": 0.1, "peak_held": 2, "peak_bytes": 1 << 20,
        ...        "weight_versions": 1, "num_microbatches": 8}
        >>> results = {"models": {"MLP": {"microbatch_size": 8, "costs": {
        ...     "forward": [0.001], "backward": [0.002], "backward_input": [0.001],
        ...     "backward_weight": [0.001], "step": [0.0], "activation_bytes": [0]},
        ...     "k": {"2": {"1f1b": {"simulated": sim, "measured": {"median_s": 0.012}}}}}},
        ...     "settings": {"reps": 3, "warmup": 1}}
        >>> schedules_table(results).rows[0][:8]
        ['MLP', 2, '1f1b', 12.0, 10.0, '+20.0%', 5333.3, 1.0]
    """
    rows = [row for model, entry in results["models"].items() for row in _rows(model, entry)]
    settings = results["settings"]
    specs = {spec["name"]: spec for spec in settings.get("specs", [])}
    costs = "; ".join(_costs_line(m, e, specs.get(m)) for m, e in results["models"].items())
    extra = [results[key] for key in ("losses", "load") if results.get(key)]
    return Table(
        key="schedules",
        title="Schedules head to head: K = 2 ranks measured, K = 4 and 8 simulated from "
              "per-layer costs measured here; M = 4K micro-batches",
        columns=list(COLUMNS),
        rows=rows,
        anchor=("the schedules against each other, in the same run: at K = 2 (measured) each "
                "schedule's Pipeline in the same 2 processes (1 thread each, gloo on "
                "127.0.0.1, nonfinite='ignore' for all: the asynchronous schedules allow "
                f"nothing else), {settings['reps']} repetitions round-robin after "
                f"{settings['warmup']} warm-up and 2 first steps, median step (max over the "
                "ranks); at every K (simulated) pipetrain's simulator fed with the per-layer "
                "costs profiled here"),
        notes=(
            "Measured (K = 2 only): 'measured ms', 'bubble measured' (the idle share of both "
            "ranks' time within the step's recorded actions, waits for messages included) "
            "and, at K = 2, 'samples/s' and 'throughput vs best'. Simulated: everything "
            "else, and 'samples/s' and 'throughput vs best' at K = 4 and 8. The simulator "
            "gets each layer's forward, backward (and its input / weight halves for the "
            "zero-bubble schedules) and optimizer step, profiled on one micro-batch by rank 0 "
            "with the machine to itself, one thread; the layers cut min-max on forward + "
            "backward into the schedule's stages (2 per rank for interleaved-1f1b, "
            "looped-bfs, zb-v, dualpipe-v; the K = 2 runs use the same cuts); no "
            "communication cost; one core per rank. pipedream and 2bw: one step in the "
            "steady state as Pipeline.train_step runs it (the pipeline already full, no "
            "flush, every rank ending the step together). Memory: the most (stage, "
            "micro-batch) activations a rank holds (a stage of the 2-per-rank schedules is "
            "half a rank's layers), and their MiB from the profiler's saved bytes per layer "
            "(estimated from the action lists, not measured); weight versions: the most a "
            f"stage keeps. Costs per micro-batch: {costs}. Where measured and simulated "
            f"disagree: {_gaps(results)}. The simulation leaves out the gloo messages over "
            "loopback (more of them for the 2-per-rank schedules), the runtime's work per "
            "action (more actions with split backwards and more stages), and the two ranks "
            "sharing the machine's caches and memory bandwidth (the profile ran alone). "
            + " ".join(extra)),
    )


def draw_schedules(tables: Sequence[Table], data: Mapping[str, Any], out: Path) -> list[str]:
    """One bar chart per model: each schedule's throughput over the best one's at each K
    (K = 2 measured and simulated, K = 4, 8 simulated); the PNG file names.

    Example::

        draw_schedules(result.tables, result.data, Path("bench-out"))
    """
    names = []
    for model, entry in data["models"].items():
        series: dict[str, list[float | None]] = {}
        schedules = list(entry["k"]["2"])
        for k_text, per_schedule in entry["k"].items():
            if k_text == "2":
                measured = relative_throughput({s: (e.get("measured") or {}).get("median_s")
                                                for s, e in per_schedule.items()})
                series["K=2 measured"] = [measured.get(s) for s in schedules]
            simulated = relative_throughput({s: e["simulated"]["makespan_s"]
                                             for s, e in per_schedule.items()})
            series[f"K={k_text} simulated"] = [simulated.get(s) for s in schedules]
        slug = "".join(ch if ch.isalnum() else "_" for ch in model.lower())
        names.append(bar_chart(out / f"schedules_{slug}.png",
                               title=f"{model}: throughput over the best schedule at each K "
                                     "(K=2 measured and simulated, K=4, 8 simulated)",
                               categories=schedules, series=series,
                               ylabel="throughput / best", reference=1.0))
    return names
