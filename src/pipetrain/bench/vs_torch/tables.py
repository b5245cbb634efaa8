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

from pipetrain.bench.case import Table
from pipetrain.bench.harness import load_line, pct, stage_ms
from pipetrain.bench.vs_torch.options import Options

__all__ = ["GOAL_COMPUTE_BOUND", "GOAL_GAP", "GOAL_RATIO", "goals", "gpt_table", "mlp_tables",
           "transformer_tables"]

GOAL_RATIO = 1.2
"""pipetrain's throughput against torch's on the MLP, every schedule both have."""
GOAL_GAP = 0.10
"""pipetrain's measured step against the simulator's prediction from its measured costs."""
GOAL_COMPUTE_BOUND = 1.1
"""pipetrain's throughput against torch's on the compute-bound transformer (gpipe, 1f1b)."""


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 1)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _not_comparable(entry: Mapping[str, Any]) -> str:
    return "; ".join(f"torch {label}: not comparable ({reason})"
                     for label, reason in entry["torch_not_comparable"].items())


def mlp_tables(result: Mapping[str, Any], opts: Options) -> list[Table]:
    """Part 1: per schedule, pipetrain vs torch and the simulator; each runner vs its ideal."""
    rows = []
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        best = entry.get("torch_best")
        theirs = entry["torch"].get(best) if best else None
        others = ", ".join(f"{label} {_x(entry['ratios'][label])}"
                           for label in entry["torch"] if label != best)
        rows.append([schedule, _ms(ours["median_s"]), _ms(theirs["median_s"]) if theirs else None,
                     best or _not_comparable(entry), _x(entry.get("ratio")),
                     _x(entry.get("ratio_bound")), _ms(ours.get("predicted_makespan_s")),
                     _ms(ours.get("measured_makespan_s")), pct(ours.get("gap")),
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
                 "pipetrain / torch throughput", "bound", "simulated ms", "measured ms",
                 "measured vs simulated", "bubble", "other torch variants"],
        rows=rows,
        anchor="torch.distributed.pipelining's schedule class for the same schedule (the "
               "fastest variant where it has several), same layers, cut, weights, batches and "
               f"optimizer, in the same 2 processes, {opts.reps} repetitions round-robin; "
               "medians of the max over the ranks",
        notes=(f"Goals: pipetrain >= {GOAL_RATIO}x torch's throughput on every schedule; its "
               f"measured step within {GOAL_GAP:.0%} of the simulator's prediction from the "
               "costs measured in the same steps. bound = torch's step / pipetrain's ideal "
               "step (what a zero-overhead pipetrain would reach). First two losses, largest "
               f"difference: {losses}. {load_line(result['load_during_timing'])}."),
        key="mlp")
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
    costs = "; ".join(f"{n} stages: F {stage_ms(c['forward'])} B {stage_ms(c['backward'])} "
                      f"SGD {stage_ms(c['step'])}" for n, c in result["isolated_costs_s"].items())
    ideal = Table(
        title="Each framework against its recorded actions and its ideal step (MLP, ms)",
        columns=["runner", "step", "actions", "outside actions", "busiest rank's compute",
                 "simulated", "actions vs simulated", "ideal", "step vs ideal", "order"],
        rows=ideal_rows,
        anchor="the ideal: each framework's own action order simulated with per-stage costs "
               "measured in isolation (plain autograd, both ranks at once, no communication)",
        notes=f"torch's actions are its stages' forward / backward calls, timed. Isolated "
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
              ["one process x 1 thread (plain PyTorch)", _ms(result["single_median_s"]),
               f"{_ms(s[0])}-{_ms(s[1])}", "1.00x"]],
        anchor=f"the same model, batches, optimizer and clipping in one process, alternating "
               f"step by step with the pipeline ({result['reps']} steps each); ideal speedup 2x",
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


def transformer_tables(result: Mapping[str, Any]) -> list[Table]:
    """Part 3: pipetrain vs torch vs one process; each step's distance from its ideal."""
    m = result["model"]
    single = result["single"]
    rows = []
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        best = entry.get("torch_best")
        theirs = entry["torch"].get(best) if best else None
        rows.append([schedule, _ms(ours["median_s"]), _ms(theirs["median_s"]) if theirs else None,
                     best or _not_comparable(entry), _x(entry.get("ratio")),
                     _ms(single["median_s"]), _x(ours["speedup_vs_single"]),
                     _x(theirs["speedup_vs_single"]) if theirs else "-",
                     _ms(ours.get("ideal_s")), _x(ours.get("ideal_speedup_vs_single"))])
    b = result["breakdown"]
    main = Table(
        title=f"Compute-bound GPT ({m['blocks']} blocks x width {m['width']}, {m['heads']} heads, "
              f"sequence {m['seq']}), batch {m['batch']} in {m['microbatches']} micro-batches, "
              f"AdamW, 2 ranks x 1 thread, cut {m['balance']} for both",
        columns=["schedule", "pipetrain ms", "torch ms", "torch schedule",
                 "pipetrain / torch throughput", "one process ms", "pipetrain speedup",
                 "torch speedup", "ideal ms", "ideal speedup"],
        rows=rows,
        anchor="torch's ScheduleGPipe / Schedule1F1B on the same cut and optimizer (its "
               "gradient scaling folded into its loss, its fastest equivalent), and the whole "
               "model in one process with one thread, interleaved in the same processes",
        notes=(f"Goal: pipetrain >= {GOAL_COMPUTE_BOUND}x torch's throughput. ideal = the "
               "schedule simulated with every layer's costs measured in one process alone. One "
               f"process on micro-batches (isolated costs) takes "
               f"{_ms(b['single_microbatched_s'])} ms ({pct(b['microbatch_efficiency_loss'])} vs "
               f"the full batch's {_ms(b['single_full_batch_s'])} ms); the cut's work per rank "
               f"{stage_ms(b['stage_work_s'])} ms. {load_line(result['load_during_timing'])}."),
        key="transformer")
    gap_rows = []
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"]),
                           *((f"torch {k}", r) for k, r in entry["torch"].items())]:
            gap_rows.append([label, _ms(row.get("ideal_s")), _ms(row.get("ideal_contended_s")),
                             _ms(row.get("predicted_makespan_s")),
                             _ms(row.get("measured_makespan_s")), _ms(row["median_s"]),
                             pct(row.get("over_ideal"))])
    gap = Table(
        title="Compute-bound GPT: from the ideal step to the measured one (ms)",
        columns=["runner", "ideal (one-process costs)", "contended (both ranks computing)",
                 "simulated (costs in the step)", "actions (+ waits, messages)",
                 "step (+ outside the actions)", "step vs ideal"],
        rows=gap_rows,
        anchor="each runner's own action order simulated with per-layer costs measured in "
               "one process alone (ideal) and per-stage costs measured with both ranks "
               "computing (contended)",
        key="transformer_gap")
    return [main, gap]


def goals(output: Mapping[str, Any]) -> dict[str, Any]:
    """Which goals the run met, per schedule (``None``: not measured).

    Example:
        >>> goals({"mlp": {"schedules": {"gpipe": {"ratio": 1.3, "pipetrain": {"gap": 0.02}}}}})
        {'gpipe': {'throughput': True, 'simulator': True}}
    """
    met: dict[str, Any] = {}
    for schedule, entry in output.get("mlp", {}).get("schedules", {}).items():
        ratio = entry.get("ratio")
        gap = entry["pipetrain"]["gap"] if entry.get("pipetrain") else None
        met[schedule] = {"throughput": None if ratio is None else ratio >= GOAL_RATIO,
                         "simulator": None if gap is None else abs(gap) <= GOAL_GAP}
    for schedule, entry in output.get("transformer", {}).get("schedules", {}).items():
        ratio = entry.get("ratio")
        met[f"transformer {schedule}"] = None if ratio is None else ratio >= GOAL_COMPUTE_BOUND
    return met
