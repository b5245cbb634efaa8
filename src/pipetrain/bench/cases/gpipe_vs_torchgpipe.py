"""Case ``gpipe_vs_torchgpipe``: pipetrain.GPipe vs torchgpipe.GPipe 0.0.7 vs plain nn.Sequential.

Each implementation in its own process, timed in turn, with each one's peak memory (the
method: :mod:`pipetrain.bench.gpipe_runs`). Full size:

- *time*: 8 x [Linear(512, 512) + ReLU], batch 256, balance [4, 4], 4 chunks,
  ``except_last``, 90 timed steps in blocks of 5 after 5 warm-up steps, three times:
  pipetrain with its defaults, with ``throttle_openmp_spin=True``, and with its three
  opt-in CPU tricks (``recompute_ahead=1``, ``reuse_gradient_buffers=True``,
  ``throttle_openmp_spin=True``); torchgpipe and plain are measured again beside each;
- *memory* (first step's peak, and the whole run's): 16 x [Linear(1024, 1024) + GELU],
  batch 2048, balance [8, 8], 8 chunks, and pipetrain's GPT (8 blocks, width 256, 128
  tokens, batch 32, balance [5, 5], 8 chunks), every checkpoint mode, pipetrain's
  defaults.

``--quick``: the time setting with pipetrain's defaults only, 6 timed steps in blocks of
3 after 1 warm-up step (its memory figures fill the memory table).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Goal, Table
from pipetrain.bench.cases.torchgpipe_paper_tables import GOAL_MEMORY, GOAL_SPEED
from pipetrain.bench.drawings import bars, find_table, texts
from pipetrain.bench.gpipe_runs import MODES, ONE_THREAD, Setting, run_mode
from pipetrain.bench.harness import spread_warnings

__all__ = ["CASE", "MEMORY_SETTINGS", "OPTION_SETS", "TIME_SETTING", "draw", "run"]

TIME_SETTING = Setting(repetitions=90)
"""The default setting of the timing: the reference MLP."""

OPTION_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "throttle_openmp_spin=True": {"throttle_openmp_spin": True},
    "all three opt-ins": {"recompute_ahead": 1, "reuse_gradient_buffers": True,
                          "throttle_openmp_spin": True},
}
"""pipetrain's options in the timing: its defaults, then its opt-in CPU tricks."""

MEMORY_SETTINGS = (
    Setting(width=1024, depth=16, activation="gelu", batch=2048, balance=(8, 8), chunks=8,
            memory_only=True),
    Setting(model="gpt", depth=8, width=256, seq=128, batch=32, balance=(5, 5), chunks=8,
            memory_only=True),
)


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value)


def _ratio(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _time_table(runs: list[tuple[str, Setting, dict[str, Any]]]) -> Table:
    rows = []
    for options, _, r in runs:
        ms = r["median_step_ms"]
        anchor = r["torchgpipe_anchor"]
        rows.append([options, round(ms["pipetrain"], 2), round(ms[anchor], 2),
                     _threads(anchor, r["torch_threads"]), round(ms["plain"], 2),
                     round(r["ratio_pipetrain_over_torchgpipe"], 2),
                     round(r["ratio_pipetrain_over_plain"], 2)])
    setting = runs[0][1]
    return Table(
        title=f"GPipe step time: {setting.describe()}, batch {setting.batch}, balance "
              f"{list(setting.balance)}, {setting.chunks} chunks, {runs[0][2]['checkpoint']}, "
              f"{setting.repetitions} timed steps",
        columns=["pipetrain options", "pipetrain ms", "torchgpipe ms", "torchgpipe threads",
                 "plain ms",
                 "pipetrain / torchgpipe throughput", "pipetrain / plain throughput"],
        rows=rows,
        anchor="torchgpipe 0.0.7 (same balance, chunks, checkpoint mode) at torch's default "
               "intra-op threads and at one thread, the faster of the two shown, and the "
               "plain nn.Sequential, each in its own process, interleaved in blocks of "
               f"{setting.block} steps with pipetrain's; medians",
        notes="Each row is its own processes (torchgpipe and plain measured again). "
              "The opt-in tricks trade memory or process-wide OpenMP state for speed on the "
              "CPU; a throughput ratio above 1 is faster than the anchor.",
        key="time",
        goals=[Goal.at_least(f"{options}: pipetrain / torchgpipe throughput",
                             r["ratio_pipetrain_over_torchgpipe"], GOAL_SPEED, unit="x")
               for options, _, r in runs if options == "defaults"])


def _threads(runner: str, default: int) -> str:
    """The intra-op threads a runner ran with, in words."""
    return "1" if runner.endswith(ONE_THREAD) else f"{default} (torch's default)"


def _memory_table(runs: list[tuple[Setting, dict[str, Any]]]) -> Table:
    rows = []
    for setting, r in runs:
        first = r["first_step_peak_mib"]
        rows.append([f"{setting.describe()}, batch {setting.batch}", r["checkpoint"],
                     *(_mib(first[n]) for n in ("pipetrain", r.get("torchgpipe_anchor",
                                                                    "torchgpipe"), "plain")),
                     _ratio(r.get("first_step_peak_pipetrain_over_torchgpipe")),
                     _ratio(r.get("run_peak_pipetrain_over_torchgpipe"))])
    return Table(
        title="GPipe peak memory (RSS growth over the first step, MiB; on a GPU the CUDA "
              "allocator's peak), pipetrain's default options",
        columns=["model", "checkpoint", "pipetrain MiB", "torchgpipe MiB", "plain MiB",
                 "pipetrain / torchgpipe, first step", "pipetrain / torchgpipe, whole run"],
        rows=rows,
        anchor="torchgpipe 0.0.7 with the same balance, chunks and checkpoint mode, and the "
               "plain nn.Sequential, each in its own process, the same weights and batch",
        notes="RSS counts what the C allocator keeps after a free and code pages loaded on "
              "first use. The whole run's peak covers the warm-up and timed steps too.",
        key="memory",
        goals=[Goal.at_most(f"{setting.describe()} {r['checkpoint']}: pipetrain / torchgpipe "
                            "peak memory, whole run", r.get("run_peak_pipetrain_over_torchgpipe"),
                            GOAL_MEMORY, unit="x") for setting, r in runs])


def run(context: BenchContext) -> BenchResult:
    """Time the option sets, then measure the memory settings; one process per
    implementation and run."""
    time_setting = replace(TIME_SETTING, repetitions=6, warmup=1, block=3) if context.quick \
        else TIME_SETTING
    option_sets = {"defaults": {}} if context.quick else OPTION_SETS
    timed: list[tuple[str, Setting, dict[str, Any]]] = []
    for label, options in option_sets.items():
        setting = replace(time_setting, pipetrain_options=options)
        context.progress(f"time, pipetrain {label}: {setting.describe()}, "
                         f"{setting.repetitions} timed steps")
        timed.append((label, setting, run_mode(setting, "except_last")))
    memory: list[tuple[Setting, dict[str, Any]]] = []
    if context.quick:
        memory = [(timed[0][1], timed[0][2])]
    else:
        for setting in MEMORY_SETTINGS:
            for mode in MODES:
                context.progress(f"memory: {setting.describe()}, {mode}")
                memory.append((setting, run_mode(setting, mode)))
    data = {"time": [{"pipetrain_options": label, "setting": asdict(s), "result": r}
                     for label, s, r in timed],
            "memory": [{"setting": asdict(s), "result": r} for s, r in memory]}
    samples = {f"{label} {name}": times for label, _, r in timed
               for name, times in r["step_ms"].items()}
    return BenchResult(tables=[_time_table(timed), _memory_table(memory)], data=data,
                       warnings=spread_warnings(samples))


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """pipetrain's throughput over torchgpipe's and the plain model's per option set, and
    the peak memory of the three per checkpoint mode, one PNG per model.

    Example::

        draw(tables, data, Path("results"))  # ['gpipe_vs_torchgpipe_time.png', ...]
    """
    names = bars(out / "gpipe_vs_torchgpipe_time.png", find_table(tables, "time"),
                 "pipetrain options",
                 {"pipetrain / torchgpipe": "pipetrain / torchgpipe throughput",
                  "pipetrain / plain": "pipetrain / plain throughput"},
                 title="GPipe step: pipetrain's throughput over torchgpipe's and the plain "
                       "model's, per option set", ylabel="throughput ratio", reference=1.0)
    memory = find_table(tables, "memory")
    models = list(dict.fromkeys(texts(memory, "model"))) if memory is not None else []
    for k, model in enumerate(models, 1):
        names += bars(out / f"gpipe_vs_torchgpipe_memory_{k}.png", memory, "checkpoint",
                      {f"{name} MiB": f"{name} MiB" for name in ("pipetrain", "torchgpipe",
                                                                 "plain")},
                      where={"model": model},
                      title=f"GPipe peak memory per checkpoint mode: {model}", ylabel="MiB")
    return names


CASE = Case(name="gpipe_vs_torchgpipe",
            title="GPipe vs torchgpipe 0.0.7 vs plain nn.Sequential: step time and peak memory",
            run=run, draw=draw, quick_seconds=8, full_seconds=230, needs=("torchgpipe",))
