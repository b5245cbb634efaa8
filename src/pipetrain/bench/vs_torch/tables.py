"""The tables of case ``vs_torch_pipelining``, from its three parts' analysed results.

Part 1 (the MLP, every schedule): pipetrain against the fastest torch variant, the
simulator's prediction of pipetrain's step, and each framework against its *ideal* step
(its own action order simulated with costs measured in isolation). Part 2 (the default
GPT): the pipeline against one process. Part 3 (the compute-bound GPT): pipetrain
against torch and one process, and the gap between each step and its ideal, in parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetrain.bench.case import Goal, Table
from pipetrain.bench.harness import load_line, pct, stage_ms
from pipetrain.bench.vs_torch.options import Options
from pipetrain.bench.vs_torch.runners import TORCH_SETTINGS

__all__ = ["GOAL_GAP", "GOAL_IDEAL", "GOAL_RATIO", "goals",
           "gpt_table", "mlp_tables",
           "ratio_goals", "transformer_tables"]

GOAL_RATIO = 1.0
"""pipetrain's throughput against torch's (at torch's fastest settings), every schedule,
both models."""
GOAL_GAP = 0.10
"""pipetrain's measured step against the simulator's prediction from its measured costs."""
GOAL_IDEAL = {1: 0.05, 2: 0.10}
"""pipetrain's step over its ideal step, by stages per rank: 5% with one stage per rank
(gpipe, 1f1b, zb-h1), 10% with two (the looped and V schedules)."""



def _settings(opts: Options) -> str:
    """What each side ran with, in the tables' words."""
    malloc = ("glibc malloc keeping freed memory for both (as pipetrain train's CPU workers "
              "do: --host-memory keep)" if opts.malloc_tuned else
              "glibc malloc at its defaults for both")
    return f"pipetrain at its defaults; torch: {TORCH_SETTINGS}; {malloc}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 1)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _met(value: float | None, ok: bool) -> str:
    return "-" if value is None else "yes" if ok else "no"


def _not_comparable(entry: Mapping[str, Any]) -> str:
    return "; ".join(f"torch {label}: not comparable ({reason})"
                     for label, reason in entry["torch_not_comparable"].items())


def _ideal_goal(schedule: str) -> float:
    from pipetrain.schedule import default_stages_per_rank

    return GOAL_IDEAL[min(2, default_stages_per_rank(schedule))]


def ratio_goals(schedules: Mapping[str, Any], *, model: str, simulator: bool) -> list[Goal]:
    """Per schedule: pipetrain >= :data:`GOAL_RATIO` x torch's throughput, its step within
    :data:`GOAL_IDEAL` of its ideal and (``simulator``) within :data:`GOAL_GAP` of the
    simulator's prediction.

    Example:
        >>> entry = {"ratio": 1.2, "pipetrain": {"over_ideal": 0.07, "gap": 0.02}}
        >>> [g.text() for g in ratio_goals({"1f1b": entry}, model="MLP", simulator=False)]
        ['MLP 1f1b: pipetrain / torch throughput 1.20x (goal >= 1.00x): met', 'MLP 1f1b: step vs ideal 7.0% (goal <= 5.0%): MISSED']
    """
    found = []
    for schedule, entry in schedules.items():
        ours = entry.get("pipetrain") or {}
        found.append(Goal.at_least(f"{model} {schedule}: pipetrain / torch throughput",
                                   entry.get("ratio"), GOAL_RATIO, unit="x"))
        found.append(Goal.at_most(f"{model} {schedule}: step vs ideal", ours.get("over_ideal"),
                                  _ideal_goal(schedule), unit="%"))
        if simulator:
            gap = ours.get("gap")
            found.append(Goal.at_most(f"{model} {schedule}: measured vs simulated",
                                      None if gap is None else abs(gap), GOAL_GAP, unit="%"))
    return found


def mlp_tables(result: Mapping[str, Any], opts: Options) -> list[Table]:
    """Part 1: per schedule, pipetrain vs torch and the simulator; each runner vs its ideal."""
    rows = []
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        best = entry.get("torch_best")
        theirs = entry["torch"].get(best) if best else None
        others = ", ".join(f"{label} {_x(entry['ratios'][label])}"
                           for label in entry["torch"] if label != best)
        ratio, over = entry.get("ratio"), ours.get("over_ideal")
        rows.append([schedule, _ms(ours["median_s"]), _ms(theirs["median_s"]) if theirs else None,
                     best or _not_comparable(entry), _x(ratio), _x(entry.get("ratio_bound")),
                     _met(ratio, ratio is not None and ratio >= GOAL_RATIO),
                     pct(over), pct(ours.get("gap")),
                     f"{ours['bubble_measured']:.1%}" if "bubble_measured" in ours else "-",
                     others or "-"])
    losses = "; ".join(
        f"{s}: {max(e['max_loss_diff_vs_torch'].values(), default=0.0):.1e} vs torch, "
        f"{e.get('max_loss_diff_vs_single_process', 0.0):.1e} vs one process"
        for s, e in result["schedules"].items())
    main = Table(
        title=f"Pipeline vs torch.distributed.pipelining, memory-bound MLP {opts.depth} x "
              f"[Linear({opts.width}, {opts.width}) + GELU], batch {opts.batch}, "
              f"{opts.microbatches} micro-batches, SGD, 2 ranks x 1 thread",
        columns=["schedule", "pipetrain ms", "torch ms", "torch schedule",
                 "pipetrain / torch throughput", "bound", f">= {GOAL_RATIO:.1f}x",
                 "step vs ideal", "measured vs simulated", "bubble", "other torch variants"],
        rows=rows,
        anchor="torch.distributed.pipelining's schedule class for the same schedule (the "
               "fastest variant where it has several), same layers, cut, weights, batches and "
               f"optimizer, in the same 2 processes, {opts.reps} repetitions round-robin; "
               f"medians of the max over the ranks. Settings: {_settings(opts)}",
        notes=(f"bound = torch's step / pipetrain's ideal step (the ratio a zero-overhead "
               "pipetrain would reach); step vs ideal = pipetrain's step over its ideal (its "
               "action order simulated with the plain-autograd costs below); measured vs simulated "
               "= its recorded actions against the simulator's prediction from the costs "
               f"measured in the same steps. First two losses, largest difference: {losses}. "
               f"{load_line(result['load_during_timing'])}."),
        key="mlp",
        goals=ratio_goals(result["schedules"], model="MLP", simulator=True))
    ideal_rows = []
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"]),
                           *((f"torch {k}", r) for k, r in entry["torch"].items())]:
            order = row.get("same_order_as_pipetrain")
            ideal_rows.append([
                label, _ms(row["median_s"]), _ms(row.get("measured_makespan_s")),
                _ms(row.get("outside_actions_s")),
                _ms(max(row["busy_s_per_rank"])) if "busy_s_per_rank" in row else None,
                _ms(row.get("predicted_makespan_s")), pct(row.get("gap")),
                _ms(row.get("ideal_s")), pct(row.get("over_ideal")),
                "-" if order is None else "same as pipetrain" if order else "its own",
            ])
    costs = "; ".join(f"{name}: F {stage_ms(c['forward'])} B {stage_ms(c['backward'])} "
                      f"SGD {stage_ms(c['step'])}" for name, c in result["plain_costs_s"].items())
    ideal = Table(
        title="Each framework against its recorded actions and its ideal step (MLP, ms)",
        columns=["runner", "step", "actions", "outside actions", "busiest rank's compute",
                 "simulated", "actions vs simulated", "ideal", "step vs ideal", "order"],
        rows=ideal_rows,
        anchor="the ideal: each framework's own action order simulated with the per-stage "
               "costs of plain autograd running pipetrain's order of the schedule (same layers, "
               "cut and optimizer; both ranks computing, no communication), timed right after "
               "the pipeline in every repetition (medians; torch's own orders take those of "
               "pipetrain's order with the same placement)",
        notes=f"torch's actions are its stages' forward / backward calls, timed. Plain-autograd "
              f"costs per stage (ms): {costs}.",
        key="mlp_ideal")
    return [main, ideal]


def gpt_table(result: Mapping[str, Any]) -> Table:
    """Part 2: the default GPT on 2 ranks against one process."""
    p = result["pipetrain"]
    q, s = result["pipeline_quartiles_s"], result["single_quartiles_s"]
    return Table(
        title="The default GPT of pipetrain train (4 blocks, width 64, 4 heads, context 128), "
              "batch 32, AdamW, clip 1.0: 2 stages vs one process",
        columns=["runner", "ms per step", "IQR ms", "speedup"],
        rows=[["pipetrain 1f1b, 2 ranks x 1 thread, 8 micro-batches",
               _ms(result["pipeline_median_s"]), f"{_ms(q[0])}-{_ms(q[1])}",
               _x(result["speedup"])],
              [f"one process x {result.get('single_threads', 1)} threads (plain PyTorch, "
               "gradients kept between steps)", _ms(result["single_median_s"]),
               f"{_ms(s[0])}-{_ms(s[1])}", "1.00x"]],
        anchor=f"the same model, batches, optimizer and clipping in one process with as many "
               f"intra-op threads as the pipeline has in all, alternating step by step with "
               f"the pipeline ({result['reps']} steps each)",
        notes=(f"Pipeline's actions span {_ms(p['measured_makespan_s'])} ms against "
               f"{_ms(p['predicted_makespan_s'])} ms simulated from its measured costs "
               f"({pct(p['gap'])}); bubble {p['bubble_measured']:.1%}; its busy time, both "
               f"ranks, {_ms(result['pipeline_busy_sum_s'])} ms "
               f"({pct(result['compute_inflation'])} vs one process's step). Speedup bounds "
               f"from that compute: {result['speedup_bound_balanced']:.2f}x balanced and "
               f"bubble-free, {result['speedup_bound_busiest_rank']:.2f}x the busiest rank "
               f"alone. First-steps loss difference {result['max_loss_diff']:.1e}. "
               f"{load_line(result['load_during_timing'])}."),
        key="gpt")


def transformer_tables(result: Mapping[str, Any], opts: Options) -> list[Table]:
    """Part 3: pipetrain vs torch vs one process; each step's distance from its ideal."""
    m = result["model"]
    single = result["single"]
    rows = []
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        best = entry.get("torch_best")
        theirs = entry["torch"].get(best) if best else None
        ratio = entry.get("ratio")
        rows.append([schedule, _ms(ours["median_s"]), _ms(theirs["median_s"]) if theirs else None,
                     best or _not_comparable(entry), _x(ratio), _x(entry.get("ratio_bound")),
                     _met(ratio, ratio is not None and ratio >= GOAL_RATIO),
                     pct(ours.get("over_ideal")), _ms(single["median_s"]),
                     _x(ours["speedup_vs_single"]),
                     _x(theirs["speedup_vs_single"]) if theirs else "-",
                     _ms(ours.get("ideal_s")), _x(ours.get("ideal_speedup_vs_single"))])
    b = result["breakdown"]
    cuts = m.get("balances") or {"2": m["balance"]}
    main = Table(
        title=f"Compute-bound GPT ({m['blocks']} blocks x width {m['width']}, {m['heads']} heads, "
              f"sequence {m['seq']}), batch {m['batch']} in {m['microbatches']} micro-batches, "
              f"AdamW, 2 ranks x 1 thread, cuts "
              + ", ".join(f"{k} stages {v}" for k, v in cuts.items()) + " for both",
        columns=["schedule", "pipetrain ms", "torch ms", "torch schedule",
                 "pipetrain / torch throughput", "bound", f">= {GOAL_RATIO:.1f}x",
                 "step vs ideal", "one process ms", "pipetrain speedup", "torch speedup",
                 "ideal ms", "ideal speedup"],
        rows=rows,
        anchor="torch's schedule class for the same schedule on the same cut and optimizer "
               "(the fastest variant where it has several), and the whole model in one process "
               f"with {single.get('threads', 2)} intra-op threads (as many as the pipeline's "
               f"ranks have in all), interleaved in the same processes. Settings: {_settings(opts)}; "
               "the one process keeps its gradients between steps too",
        notes=("bound = torch's step / pipetrain's ideal step; ideal = the schedule simulated "
               "with the per-stage costs of plain autograd running its order in the same loop "
               "(both ranks computing, no communication). One "
               f"process on micro-batches (isolated costs, 1 thread) takes "
               f"{_ms(b['single_microbatched_s'])} ms ({pct(b['microbatch_efficiency_loss'])} vs "
               f"the full batch's {_ms(b['single_full_batch_s'])} ms); the 2-stage cut's work "
               f"per rank {stage_ms(b['stage_work_s'])} ms. "
               f"{load_line(result['load_during_timing'])}."),
        key="transformer",
        goals=ratio_goals(result["schedules"], model="GPT", simulator=False))
    gap_rows = []
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"]),
                           *((f"torch {k}", r) for k, r in entry["torch"].items())]:
            gap_rows.append([label, _ms(row.get("ideal_one_process_s")),
                             _ms(row.get("ideal_contended_s")), _ms(row.get("ideal_s")),
                             _ms(row.get("predicted_makespan_s")),
                             _ms(row.get("measured_makespan_s")), _ms(row["median_s"]),
                             pct(row.get("over_ideal"))])
    gap = Table(
        title="Compute-bound GPT: from the ideal step to the measured one (ms)",
        columns=["runner", "one process (layer costs)", "contended (both ranks computing)",
                 "ideal (plain autograd, the order, in the loop)",
                 "simulated (costs in the step)", "actions (+ waits, messages)",
                 "step (+ outside the actions)", "step vs ideal"],
        rows=gap_rows,
        anchor="each runner's own action order simulated with per-layer costs measured in "
               "one process alone, with per-stage costs measured with both ranks computing "
               "before the timed loop (contended), and with the per-stage costs of plain "
               "autograd running the schedule's order in the timed loop (ideal)",
        key="transformer_gap")
    return [main, gap]


def goals(output: Mapping[str, Any]) -> dict[str, Any]:
    """Which goals the run met (``None``: not measured), by goal.

    Example:
        >>> entry = {"ratio": 1.3, "pipetrain": {"gap": 0.02, "over_ideal": 0.03}}
        >>> goals({"mlp": {"schedules": {"gpipe": entry}}})["MLP gpipe: step vs ideal"]
        True
    """
    found = [*ratio_goals(output.get("mlp", {}).get("schedules", {}), model="MLP",
                          simulator=True),
             *ratio_goals(output.get("transformer", {}).get("schedules", {}), model="GPT",
                          simulator=False)]
    return {g.name: g.met for g in found}
