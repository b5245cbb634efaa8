"""Case ``async_convergence``: asynchronous schedules vs synchronous 1F1B on equal terms, on the default language-model task.

The model and data of ``pipetrain train`` (a byte-level GPT: 4 blocks, width 64, 4 heads,
context 128; the Python standard library's source; batches of 32 sequences drawn by step;
AdamW, betas (0.9, 0.95), weight decay 0.1; linear warm-up then a cosine to 0.1 of the
peak), trained by the runners of :mod:`.async_convergence_runs` in the same processes
(``stages`` ranks, gloo, 1 thread each), from the same weights on the same batches:

- ``1f1b``: synchronous, as ``pipetrain train`` runs it (tied embeddings, gradient
  clipping at 1.0);
- ``1f1b-untied``: synchronous with the asynchronous runners' settings (untied
  embeddings, no clipping): the equal they are compared with;
- ``pipedream`` and ``2bw``: asynchronous (no flush; one update per micro-batch, resp.
  per step with a one-step delay), untied and unclipped, as ``pipetrain train
  --schedule pipedream|2bw`` trains them. PipeDream applies ``M`` updates per step, with
  the same learning rate (``lr_scale`` multiplies it).

Two tables. ``convergence``: every runner at peak LR ``lr`` for ``steps`` steps,
interleaved step by step; per runner the median step time after ``skip`` warm-up steps
and the throughput ratio to ``1f1b-untied``'s (above 1: faster), the mean training loss
of the last tenth of the steps, and the validation loss (``val_batches`` validation
batches) with its ratios to ``1f1b-untied``'s and ``1f1b``'s. ``gap_sweep``: 2BW's
validation-loss gap to ``1f1b-untied`` (``2bw / 1f1b-untied - 1``) for every peak LR of
``sweep_lrs`` and number of steps of ``sweep_steps`` (the warm-up in proportion), each a
run of the two interleaved (the comparison's run where it is one of them), and the
recipe: the fewest steps ``N``, then the largest peak LR ``X``, such that every swept
setting with at least ``N`` steps and a peak LR of at most ``X`` is within ``threshold``
(2%) (:func:`recipe`). Every validation loss is taken on the weights the runner's
checkpoint saves (see :mod:`.async_convergence_runs`).

Full size: the comparison 300 steps at peak LR 1e-2 (4 runners), the sweep 100 and 300
steps x peak LR 1e-2, 3e-3, 1e-3, 3e-4; 2 stages, 8 micro-batches of 4 sequences.
``--quick``: 10 steps, the sweep 10 steps x peak LR 1e-2 and 1e-3.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.cases.async_convergence_runs import RUNNERS, Options, Setting, job
from pipetrain.bench.harness import run_job

__all__ = ["CASE", "FULL", "QUICK", "RUNNERS", "Options", "draw", "recipe", "run", "settings",
           "summarize", "sweep_rows"]

FULL = Options()
QUICK = replace(FULL, steps=10, warmup=3, skip=3, val_batches=2, sweep_steps=(10,),
                sweep_lrs=(1e-2, 1e-3))
SWEPT = ("1f1b-untied", "2bw")
"""The runners of the sweep: 2BW and its equal."""


def settings(options: Options) -> list[Setting]:
    """The runs: the comparison of every runner first, then each point of the sweep the
    comparison does not already hold.

    Example:
        >>> [s.label for s in settings(replace(QUICK, sweep_steps=(5, 10)))]
        ['10 steps, peak LR 0.01', '5 steps, peak LR 0.01', '5 steps, peak LR 0.001', '10 steps, peak LR 0.001']
    """
    main = Setting(steps=options.steps, warmup=options.warmup_for(options.steps), lr=options.lr,
                   runners=options.runners)
    found = [main]
    for steps in options.sweep_steps:
        for lr in options.sweep_lrs:
            if (steps, lr) == (main.steps, main.lr) and all(n in main.runners for n in SWEPT):
                continue
            found.append(Setting(steps=steps, warmup=options.warmup_for(steps), lr=lr,
                                 runners=SWEPT))
    return found


def recipe(gaps: dict[tuple[int, float], float], threshold: float) -> tuple[int, float] | None:
    """The setting ``(steps N, peak LR X)`` with the fewest steps, then the largest peak
    LR, such that every setting of ``gaps`` with at least ``N`` steps and a peak LR of
    at most ``X`` has a gap of at most ``threshold``; ``None`` when none has.

    Example:
        >>> gaps = {(100, 1e-2): 0.3, (100, 1e-3): 0.05, (300, 1e-2): 0.2, (300, 1e-3): 0.01}
        >>> recipe(gaps, 0.02)
        (300, 0.001)
        >>> recipe({**gaps, (300, 1e-3): 0.03}, 0.02) is None
        True
    """
    candidates = sorted(gaps, key=lambda point: (point[0], -point[1]))
    for steps, lr in candidates:
        covered = [gap for (s, x), gap in gaps.items() if s >= steps and x <= lr]
        if all(gap <= threshold for gap in covered):
            return steps, lr
    return None


def summarize(result: dict[str, Any], options: Options) -> dict[str, Any]:
    """The comparison per runner (median step, last-tenth training loss, validation loss,
    ratios to ``1f1b-untied`` and ``1f1b``), the sweep's gaps and the recipe.

    Example:
        >>> runs = [{"seconds": {"1f1b-untied": [2.0, 2.0], "2bw": [1.0, 1.0]},
        ...          "losses": {"1f1b-untied": [3.0, 2.0], "2bw": [3.0, 2.2]},
        ...          "val": {"1f1b-untied": 2.0, "2bw": 2.1}, "own_eval": {}}]
        >>> out = summarize({"runs": runs}, Options(steps=2, skip=0, runners=("1f1b-untied", "2bw"),
        ...                                         sweep_steps=(2,), sweep_lrs=(0.01,)))
        >>> row = out["runners"]["2bw"]
        >>> row["throughput_vs"]["1f1b-untied"], round(row["val_loss_vs"]["1f1b-untied"], 2)
        (2.0, 1.05)
        >>> out["sweep"][0]["gap"] > 0.02, out["recipe"]
        (True, None)
    """
    runs = settings(options)
    first = result["runs"][0]
    skip, tail = options.skip, max(1, options.steps // 10)
    rows: dict[str, dict[str, Any]] = {}
    for name in options.runners:
        timed = first["seconds"][name][skip:] or first["seconds"][name]
        rows[name] = {"median_step_seconds": statistics.median(timed),
                      "train_loss_last_tenth": statistics.fmean(first["losses"][name][-tail:]),
                      "val_loss": first["val"][name],
                      "own_eval_loss": first["own_eval"].get(name),
                      "throughput_vs": {}, "val_loss_vs": {}}
    for row in rows.values():
        for anchor in ("1f1b-untied", "1f1b"):
            if anchor in rows:
                row["throughput_vs"][anchor] = (rows[anchor]["median_step_seconds"]
                                                / row["median_step_seconds"])
                row["val_loss_vs"][anchor] = row["val_loss"] / rows[anchor]["val_loss"]
    sweep = []
    for steps in options.sweep_steps:
        for lr in options.sweep_lrs:
            k = next(k for k, s in enumerate(runs)
                     if (s.steps, s.lr) == (steps, lr) and all(n in s.runners for n in SWEPT))
            val = result["runs"][k]["val"]
            sweep.append({"steps": steps, "warmup": runs[k].warmup, "lr": lr,
                          "val_1f1b_untied": val["1f1b-untied"], "val_2bw": val["2bw"],
                          "gap": val["2bw"] / val["1f1b-untied"] - 1.0})
    found = recipe({(p["steps"], p["lr"]): p["gap"] for p in sweep}, options.threshold)
    return {"options": asdict(options), "samples": options.steps * options.batch_size,
            "runners": rows, "losses": first["losses"], "sweep": sweep,
            "recipe": None if found is None else {"steps": found[0], "lr": found[1]}}


def sweep_rows(summary: dict[str, Any], threshold: float) -> list[list[Any]]:
    """The rows of table ``gap_sweep``: by steps, then peak LR from the largest.

    Example:
        >>> summary = {"sweep": [{"steps": 10, "warmup": 2, "lr": 0.01, "val_1f1b_untied": 2.0,
        ...                       "val_2bw": 2.02, "gap": 0.01}], "recipe": {"steps": 10, "lr": 0.01}}
        >>> sweep_rows(summary, 0.02)
        [[10, 2, 0.01, 2.0, 2.02, '+1.0%', 'yes: the recipe']]
    """
    marked = summary["recipe"]
    rows = []
    for point in sorted(summary["sweep"], key=lambda p: (p["steps"], -p["lr"])):
        within = "yes" if point["gap"] <= threshold else "no"
        if marked is not None and (point["steps"], point["lr"]) == (marked["steps"], marked["lr"]):
            within = "yes: the recipe"
        rows.append([point["steps"], point["warmup"], point["lr"],
                     round(point["val_1f1b_untied"], 4), round(point["val_2bw"], 4),
                     f"{100 * point['gap']:+.1f}%", within])
    return rows


_WEIGHTS = ("Validation losses are taken on the weights each runner's checkpoint saves "
            "(Pipeline.save, which drains the asynchronous pipelines first, loaded into a "
            "synchronous pipeline that evaluates): for 1f1b and 1f1b-untied the weights "
            "after the last step; for pipedream its live weights once the drain has applied "
            "the updates of the micro-batches in flight; for 2bw its live weights W(T), with "
            "all T updates applied (its checkpoint keeps W(T-1) beside them for the next "
            "forward; its own eval_step would use W(T-1)).")


def tables(summary: dict[str, Any], options: Options) -> list[Table]:
    """Tables ``convergence`` and ``gap_sweep`` of a :func:`summarize` result.

    Example::

        convergence, gap_sweep = tables(summarize(result, options), options)
    """
    sizes = (f"default LM task, {options.stages} stages x 1 thread, M = {options.microbatches}, "
             f"{options.batch_size} sequences per step")

    def ratio(row: dict[str, Any], key: str, anchor: str) -> Any:
        value = row[key].get(anchor)
        return None if value is None else round(value, 3)

    convergence = Table(
        title=f"Asynchronous schedules vs 1F1B on equal terms: {sizes}, {options.steps} steps, "
              f"peak LR {options.lr:g}",
        columns=["schedule", "embeddings", "clip", "median step ms", "throughput / 1f1b-untied",
                 "train loss (last tenth)", "val loss", "val loss / 1f1b-untied",
                 "val loss / 1f1b"],
        rows=[[name, "tied" if RUNNERS[name].tied else "untied",
               options.clip if RUNNERS[name].clipped else "-",
               round(row["median_step_seconds"] * 1e3, 1),
               ratio(row, "throughput_vs", "1f1b-untied"),
               round(row["train_loss_last_tenth"], 4), round(row["val_loss"], 4),
               ratio(row, "val_loss_vs", "1f1b-untied"), ratio(row, "val_loss_vs", "1f1b")]
              for name, row in summary["runners"].items()],
        anchor="1f1b-untied (synchronous, untied embeddings, no clipping: the asynchronous "
               "runners' settings), in the same processes, interleaved step by step, same "
               "weights and batches; 1f1b is pipetrain train's default (tied, clipping)",
        notes=f"Peak LR {options.lr:g} for all (PipeDream x "
              f"{options.lr_scale.get('pipedream', 1.0):g}, 2BW x "
              f"{options.lr_scale.get('2bw', 1.0):g}), warm-up "
              f"{options.warmup_for(options.steps)} steps then a cosine to 0.1 of the peak. "
              f"{_WEIGHTS} Throughput above 1 is faster than 1f1b-untied.",
        key="convergence")
    marked = summary["recipe"]
    found = ("the recipe (marked) is the fewest steps, then the largest peak LR, at which "
             "every swept setting with at least as many steps and at most that peak LR is "
             f"within {100 * options.threshold:g}%" if marked is not None else
             "no recipe on this grid: for no swept setting (N steps, peak LR X) is every "
             f"swept setting with at least N steps and a peak LR of at most X within "
             f"{100 * options.threshold:g}%")
    sweep = Table(
        title=f"2BW's validation-loss gap to 1f1b-untied by peak LR and steps: {sizes}",
        columns=["steps", "warm-up", "peak LR", "1f1b-untied val loss", "2bw val loss",
                 "2bw gap", f"within {100 * options.threshold:g}%"],
        rows=sweep_rows(summary, options.threshold),
        anchor="1f1b-untied at the same peak LR, steps and warm-up, interleaved step by step "
               "with 2bw in the same processes, same weights and batches",
        notes=f"Gap: 2bw val loss / 1f1b-untied val loss - 1; {found}. The warm-up is "
              f"{options.warmup} of {options.steps} steps in proportion, then a cosine to 0.1 "
              f"of the peak. {_WEIGHTS}",
        key="gap_sweep")
    return [convergence, sweep]


def _smoothed(values: list[float], window: int) -> list[float | None]:
    """The mean of each window of ``window`` steps ending at each step."""
    return [statistics.fmean(values[max(0, k + 1 - window):k + 1]) for k in range(len(values))]


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Two pictures: 2BW's gap by peak LR (one bar per step count, the threshold as a
    dashed line) from table ``gap_sweep``; the training losses of the comparison (a
    moving mean over a thirtieth of the steps) from the data.

    Example::

        draw(result.tables, result.data, Path("bench-results/full"))
    """
    from pipetrain.bench.drawings import find_table, series, texts
    from pipetrain.bench.plots import bar_chart, line_chart

    names = []
    table = find_table(tables, "gap_sweep")
    if table is not None and table.rows:
        lrs = list(dict.fromkeys(texts(table, "peak LR")))
        bars: dict[str, list[float | None]] = {}
        for count in dict.fromkeys(texts(table, "steps")):
            labels, values = series(table, "peak LR", {"gap": "2bw gap"}, where={"steps": count})
            found = dict(zip(labels, values["gap"]))
            bars[f"{count} steps"] = [found.get(lr) for lr in lrs]
        threshold = 100 * float(data.get("options", {}).get("threshold", 0.02))
        names.append(bar_chart(out / "async_convergence_gap.png",
                               title="2BW's validation-loss gap to 1f1b-untied by peak LR",
                               categories=[f"peak LR {lr}" for lr in lrs], series=bars,
                               ylabel="gap (%)", reference=threshold,
                               reference_label=f"{threshold:g}%"))
    losses: dict[str, list[float]] = data.get("losses") or {}
    if losses:
        steps = max(len(v) for v in losses.values())
        window = max(1, steps // 30)
        names.append(line_chart(
            out / "async_convergence_loss.png",
            title="Training loss per step" + (f" (moving mean over {window} steps)"
                                              if window > 1 else ""),
            x=list(range(1, steps + 1)),
            series={name: _smoothed(values, window) for name, values in losses.items()},
            xlabel="step", ylabel="training loss",
            styles={name: {"marker": ""} for name in losses}))
    return names


def run(context: BenchContext) -> BenchResult:
    """Every setting in one job (the comparison, then the sweep); the two tables."""
    options = QUICK if context.quick else FULL
    options = replace(options, skip=min(options.skip, max(options.steps - 1, 0)))
    runs = settings(options)
    context.progress(f"{options.stages} stages, {len(runs)} runs: {runs[0].label} "
                     f"({', '.join(runs[0].runners)}), then 2bw and 1f1b-untied at "
                     f"{', '.join(s.label for s in runs[1:])}")
    with tempfile.TemporaryDirectory(prefix="async_convergence-") as scratch:
        result = run_job(job, options, runs, scratch, world_size=options.stages,
                         timeout=7200)[0]
    summary = summarize(result, options)
    return BenchResult(tables=tables(summary, options), data=summary)


CASE = Case(name="async_convergence",
            title="PipeDream and 2BW vs synchronous 1F1B on equal terms: loss, speed, 2BW's "
                  "gap by learning rate and steps",
            run=run, draw=draw, quick_seconds=15, full_seconds=710)
