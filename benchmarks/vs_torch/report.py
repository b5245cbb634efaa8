"""The text reports of ``benchmarks/vs_torch_pipelining.py``'s parts."""

from __future__ import annotations

from typing import Any

from pipetrain.bench.harness import load_line, ms, pct, stage_ms

__all__ = ["GOAL_COMPUTE_BOUND", "GOAL_GAP", "GOAL_RATIO", "print_gpt", "print_mlp", "print_transformer"]

GOAL_RATIO = 1.2
"""pipetrain's throughput against torch's on the MLP, every schedule both have."""
GOAL_GAP = 0.10
"""pipetrain's measured step against the simulator's prediction from its measured costs."""


def print_mlp(result: dict[str, Any], opts: Any) -> None:
    print(f"\n== Part 1: MLP {opts.depth} x [Linear({opts.width},{opts.width})+GELU], batch "
          f"{opts.batch}, {opts.microbatches} micro-batches, SGD, 2 ranks x 1 thread ==")
    print(f"medians over {opts.reps} round-robin repetitions (after {opts.warmup} warm-up), "
          "max over ranks; ms per training step")
    print(load_line(result["load_during_timing"]) + "\n")
    header = (f"{'schedule':17} {'pipetrain':>9} {'torch':>9} {'steps/s':>11} {'ratio':>6} "
              f"{'bound':>6}  {'predicted':>9} {'measured':>8} {'gap':>7}  {'bubble':>6}  "
              "torch schedule")
    print(header)
    print("-" * len(header))
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        torch_best = entry.get("torch_best")
        t = entry["torch"].get(torch_best) if torch_best else None
        ratio = f"{entry['ratio']:.2f}x" if t else "-"
        bound = f"{entry['ratio_bound']:.2f}x" if "ratio_bound" in entry else "-"
        rates = f"{ours['steps_per_s']:.2f}/" + (f"{t['steps_per_s']:.2f}" if t else "-")
        print(f"{schedule:17} {ms(ours['median_s']):>9} {ms(t['median_s'] if t else None):>9} "
              f"{rates:>11} {ratio:>6} {bound:>6}  "
              f"{ms(ours['predicted_makespan_s']):>9} {ms(ours['measured_makespan_s']):>8} "
              f"{pct(ours['gap']):>7}  {ours['bubble_measured']:6.1%}  "
              f"{torch_best or 'torch: not comparable'}")
        for label, row in entry["torch"].items():
            if label != torch_best:
                print(f"{'':17} {'':>9} {ms(row['median_s']):>9} "
                      f"{'-/' + format(row['steps_per_s'], '.2f'):>11} "
                      f"{entry['ratios'][label]:5.2f}x {'':>6}  {'':>9} {'':>8} {'':>7}  "
                      f"{'':>6}  {label}")
        for label, reason in entry["torch_not_comparable"].items():
            print(f"{'':17} torch: not comparable ({label}: {reason})")
    print("\nsteps/s = pipetrain/torch; ratio = torch step time / pipetrain step time (> 1: "
          "pipetrain faster; goal >= "
          f"{GOAL_RATIO}x),\nagainst the fastest torch variant; bound = torch / pipetrain's ideal "
          "step (below),\nthe best ratio a zero-overhead pipetrain could reach. predicted = simulate(pipetrain's "
          "schedule, costs measured in the same steps);\nmeasured = makespan of the recorded "
          f"actions (goal: within {GOAL_GAP:.0%}); bubble = measured idle share of both ranks.")

    print("\nSame work? losses of the first two steps (same initial weights, same batches):")
    print(f"  single process reference: {result['reference_losses']}")
    for schedule, entry in result["schedules"].items():
        diffs = ", ".join(f"{label} {d:.1e}" for label, d in entry["max_loss_diff_vs_torch"].items())
        print(f"  {schedule:17} max |pipetrain - torch| = {diffs or '-'}; "
              f"|pipetrain - single process| = {entry.get('max_loss_diff_vs_single_process', 0):.1e}")

    print("\nEach framework against its own recorded actions (torch: its stages' forward / "
          "backward calls timed) and against an ideal step\n(its own action order simulated "
          "with per-stage costs measured in isolation, no communication), ms:")
    print(f"  {'':40} {'step':>6} {'actions':>7} {'outside':>7} {'busy':>6} {'sim':>6} "
          f"{'gap':>7} {'ideal':>6} {'over':>7}")
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"])] + [
                (f"torch {label}", row) for label, row in entry["torch"].items()]:
            busy = max(row["busy_s_per_rank"]) if "busy_s_per_rank" in row else None
            print(f"  {label:40} {ms(row['median_s']):>6} "
                  f"{ms(row.get('measured_makespan_s')):>7} "
                  f"{ms(row.get('outside_actions_s')):>7} {ms(busy):>6} "
                  f"{ms(row.get('predicted_makespan_s')):>6} {pct(row.get('gap')):>7} "
                  f"{ms(row.get('ideal_s')):>6} {pct(row.get('over_ideal')):>7}"
                  + ("" if row.get("same_order_as_pipetrain") is None else
                     "  (same order as pipetrain)" if row["same_order_as_pipetrain"] else
                     "  (its own order)")
                  + (f"  [no simulation: {row['ideal_error']}]" if "ideal_error" in row else ""))
    print("  step = median step time; actions = makespan of the recorded compute (pipetrain: "
          "all) actions; outside = step - actions;\n  busy = busiest rank's compute + optimizer;"
          " sim = simulated makespan from the measured costs, gap = actions vs sim;\n  ideal = "
          "isolated-cost simulation, over = step vs ideal.")
    for n, c in result["isolated_costs_s"].items():
        print(f"  isolated costs, {n} stages (ms): F {stage_ms(c['forward'])} "
              f"B {stage_ms(c['backward'])} SGD {stage_ms(c['step'])}")

    print("\nWhere the time goes (median ms per step, per rank; per-stage means in ms):")
    for schedule, entry in result["schedules"].items():
        rows = [(f"pipetrain {schedule}", entry["pipetrain"])] + [
            (f"torch {label}", row) for label, row in entry["torch"].items()]
        for label, row in rows:
            if "op_seconds_per_rank" not in row:
                continue
            mc = row["measured_costs_s"]
            extra = ""
            if "predicted_with_send_costs_s" in row and row["framework"] == "pipetrain":
                extra = (f"; sim incl. send time {ms(row['predicted_with_send_costs_s']).strip()}"
                         f" ({pct(row['gap_with_send_costs'])})")
            if "scale_grads_s" in row:
                extra += f"; scale_grads {ms(row['scale_grads_s']).strip()}"
            print(f"  {label}: F {stage_ms(mc['forward'])} B {stage_ms(mc['backward'])}"
                  + (f" I {stage_ms(mc['backward_input'])} W {stage_ms(mc['backward_weight'])}"
                     if "I" in row["op_seconds_per_rank"][0] or "I" in row["op_seconds_per_rank"][1]
                     else "")
                  + (f" latency {stage_ms(mc['communication'])}"
                     if row["framework"] == "pipetrain" else "") + extra)
            for r, ops in enumerate(row["op_seconds_per_rank"]):
                text = " ".join(f"{op} {1e3 * v:.1f}" for op, v in sorted(ops.items()))
                print(f"    rank {r}: {text}; CPU: main thread "
                      f"{1e3 * row['main_thread_cpu_s_per_rank'][r]:.1f}, other threads "
                      f"{1e3 * row['other_threads_cpu_s_per_rank'][r]:.1f}")


def print_gpt(result: dict[str, Any]) -> None:
    print("\n== Part 2: GPT (pipetrain train's default: 4 layers, width 64, 4 heads, context "
          "128), batch 32, AdamW, clip 1.0 ==")
    print(f"pipetrain 1f1b, 2 ranks x 1 thread, 8 micro-batches: {ms(result['pipeline_median_s'])}"
          f" ms/step (IQR {ms(result['pipeline_quartiles_s'][0]).strip()}-"
          f"{ms(result['pipeline_quartiles_s'][1]).strip()})")
    print(f"one process x 1 thread (plain PyTorch):              {ms(result['single_median_s'])}"
          f" ms/step (IQR {ms(result['single_quartiles_s'][0]).strip()}-"
          f"{ms(result['single_quartiles_s'][1]).strip()})")
    p = result["pipetrain"]
    print(load_line(result["load_during_timing"]))
    print(f"speedup {result['speedup']:.2f}x (ideal 2x); medians over {result['reps']} "
          f"alternating steps; first-steps loss diff {result['max_loss_diff']:.1e}")
    print(f"pipeline: actions' makespan {ms(p['measured_makespan_s']).strip()} ms vs simulated "
          f"{ms(p['predicted_makespan_s']).strip()} ms from its measured costs "
          f"({pct(p['gap'])}; with send time {ms(p['predicted_with_send_costs_s']).strip()} ms, "
          f"{pct(p['gap_with_send_costs'])}); outside actions "
          f"{ms(p['outside_actions_s']).strip()} ms; bubble {p['bubble_measured']:.1%}")
    print(f"  busy (F + B + STEP) per rank {[round(1e3 * b, 1) for b in p['busy_s_per_rank']]} ms,"
          f" together {ms(result['pipeline_busy_sum_s']).strip()} ms = "
          f"{pct(result['compute_inflation'])} vs the single process's step; per micro-batch F "
          f"{stage_ms(p['measured_costs_s']['forward'])} B "
          f"{stage_ms(p['measured_costs_s']['backward'])} STEP "
          f"{stage_ms(p['measured_costs_s']['step'])} ms per stage")
    print(f"  speedup bounds from that compute: balanced and bubble-free "
          f"{result['speedup_bound_balanced']:.2f}x, busiest rank alone "
          f"{result['speedup_bound_busiest_rank']:.2f}x")
    for r, ops in enumerate(p["op_seconds_per_rank"]):
        text = " ".join(f"{op} {1e3 * v:.1f}" for op, v in sorted(ops.items()))
        print(f"    rank {r}: {text}; CPU: main thread "
              f"{1e3 * result['main_thread_cpu_s_per_rank'][r]:.1f}, other threads "
              f"{1e3 * result['other_threads_cpu_s_per_rank'][r]:.1f}")
    print(f"  (rank 1's CPU while rank 0 ran the single-process step: "
          f"{ms(result['idle_rank_cpu_s_during_single']).strip()} ms)")


GOAL_COMPUTE_BOUND = 1.1
"""pipetrain's throughput against torch's on the compute-bound transformer (gpipe, 1f1b)."""


def _gap_line(label: str, row: dict[str, Any]) -> str:
    """The step against its ideal, in parts: contention, compute in the step, waits, outside."""
    ideal, contended = row.get("ideal_s"), row.get("ideal_contended_s")
    sim, makespan = row.get("predicted_makespan_s"), row.get("measured_makespan_s")
    step = row["median_s"]
    parts = [ms(ideal), ms(contended), ms(sim), ms(makespan), ms(step), pct(row.get("over_ideal"))]
    return f"  {label:32} " + " ".join(f"{p:>9}" for p in parts)


def print_transformer(result: dict[str, Any]) -> None:
    m = result["model"]
    print(f"\n== Part 3: compute-bound GPT, {m['blocks']} blocks x width {m['width']}, "
          f"{m['heads']} heads, sequence {m['seq']}, batch {m['batch']} in {m['microbatches']} "
          f"micro-batches, AdamW, 2 ranks x 1 thread; cut {m['balance']} (both frameworks) ==")
    print(load_line(result["load_during_timing"]))
    single = result["single"]
    print(f"one process, 1 thread, full batch: {ms(single['median_s']).strip()} ms/step (IQR "
          f"{ms(single['quartiles_s'][0]).strip()}-{ms(single['quartiles_s'][1]).strip()}); "
          f"on micro-batches (sum of the layers' isolated costs x M + step): "
          f"{ms(result['single_microbatched_ideal_s']).strip()} ms")
    header = (f"{'schedule':9} {'pipetrain':>9} {'torch':>9} {'ratio':>6} {'speedup':>8} "
              f"{'ideal':>7} {'ideal x':>8} {'torch speedup':>13}  torch schedule")
    print(header)
    print("-" * len(header))
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        best = entry.get("torch_best")
        theirs = entry["torch"].get(best) if best else None
        print(f"{schedule:9} {ms(ours['median_s']):>9} "
              f"{ms(theirs['median_s'] if theirs else None):>9} "
              f"{(format(entry['ratio'], '.2f') + 'x') if theirs else '-':>6} "
              f"{ours['speedup_vs_single']:7.2f}x {ms(ours.get('ideal_s')):>7} "
              f"{ours.get('ideal_speedup_vs_single', float('nan')):7.2f}x "
              f"{(format(theirs['speedup_vs_single'], '.2f') + 'x') if theirs else '-':>13}  "
              f"{best or 'torch: not comparable'}")
        for label, reason in entry["torch_not_comparable"].items():
            print(f"{'':9} torch: not comparable ({label}: {reason})")
    print(f"ratio = torch step / pipetrain step (goal >= {GOAL_COMPUTE_BOUND}x); speedup = one "
          "process's step / the pipeline's; ideal = the schedule simulated with every layer's\n"
          "costs measured in one process alone; ideal x = the speedup that ideal would give.")
    print("\nThe gap, ms: ideal (one-process costs) -> contended (costs measured with both ranks "
          "computing) -> sim (costs measured\nin the step) -> actions (their makespan: + waits, "
          "messages) -> step (+ outside the actions), and step vs ideal:")
    print(f"  {'':32} " + " ".join(f"{h:>9}" for h in (
        "ideal", "contended", "sim", "actions", "step", "over")))
    for schedule, entry in result["schedules"].items():
        print(_gap_line(f"pipetrain {schedule}", entry["pipetrain"]))
        for label, row in entry["torch"].items():
            print(_gap_line(f"torch {label}", row))
    b = result["breakdown"]
    print(f"\nFrom one process to the ideal pipeline (isolated costs only): full batch "
          f"{ms(b['single_full_batch_s']).strip()} ms; on micro-batches "
          f"{ms(b['single_microbatched_s']).strip()} ms ({pct(b['microbatch_efficiency_loss'])}: "
          f"smaller GEMMs); half of that (2 ranks, perfect balance, no bubble) "
          f"{ms(b['half_of_microbatched_s']).strip()} ms; the cut's work per rank "
          f"{stage_ms(b['stage_work_s'])} ms; ideal 1f1b {ms(b['ideal_1f1b_s']).strip()} ms, "
          f"gpipe {ms(b['ideal_gpipe_s']).strip()} ms (+ the bubble: a stage's first forward "
          "and last backward alone, the optimizer steps)")
    one, both = result["stage_costs_one_process_s"], result["stage_costs_contended_s"]
    print(f"  stage costs, one process (ms): F {stage_ms(one['forward'])} B "
          f"{stage_ms(one['backward'])} step {stage_ms(one['step'])}")
    print(f"  stage costs, both ranks at once: F {stage_ms(both['forward'])} B "
          f"{stage_ms(both['backward'])} step {stage_ms(both['step'])}")
    print("\nWhere the time goes (median ms per step, per rank; per-stage means in ms):")
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"]),
                           *((f"torch {k}", r) for k, r in entry["torch"].items())]:
            if "op_seconds_per_rank" not in row:
                continue
            mc = row["measured_costs_s"]
            print(f"  {label}: F {stage_ms(mc['forward'])} B {stage_ms(mc['backward'])} step "
                  f"{stage_ms(mc['step'])}"
                  + (f"; scale_grads {ms(row['scale_grads_s']).strip()}"
                     if "scale_grads_s" in row else ""))
            for r, ops in enumerate(row["op_seconds_per_rank"]):
                text = " ".join(f"{op} {1e3 * v:.1f}" for op, v in sorted(ops.items()))
                print(f"    rank {r}: {text}; CPU: main thread "
                      f"{1e3 * row['main_thread_cpu_s_per_rank'][r]:.1f}, other threads "
                      f"{1e3 * row['other_threads_cpu_s_per_rank'][r]:.1f}")
    print("\nSame work? losses of the first two steps:")
    for schedule, entry in result["schedules"].items():
        print(f"  {schedule}: {entry['first_losses']}; |pipetrain - one process| = "
              f"{entry.get('max_loss_diff_vs_single_process', float('nan')):.1e}")
