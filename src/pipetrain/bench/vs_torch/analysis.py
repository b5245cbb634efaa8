"""Where the time goes: the recorded actions of the timed steps against the simulator.

pipetrain records every action it runs; torch's runner times its stages' compute calls.
For every timed step both ranks' actions are put on one time axis
(``offsets_from_origins``) and the makespan compared with the simulator's prediction
from the costs measured in the same step (``simulate(schedule, measure_step(...)
.mean_costs)``), also with the time the sends took on the sender added to the compute
before them (the simulator counts a send as free). :func:`runner_rows` adds each
runner's step times, CPU use and its *ideal* step (its order simulated with the costs it
is given, e.g. those of plain autograd running the order: :mod:`.plain`); :func:`compare`
groups the rows by schedule with the ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipetrain.bench.harness import median, step_times, summary
from pipetrain.bench.vs_torch.costs import ideal, torch_schedule_as_pipetrain
from pipetrain.bench.vs_torch.runners import TORCH_VARIANTS, WORLD_SIZE

__all__ = ["compare", "runner_rows", "timeline_analysis"]


def timeline_analysis(records: Sequence[Sequence[tuple[float, list[Any]]]], schedule: Any,
                      times: Sequence[float]) -> dict[str, Any]:
    """Measured makespan vs the simulator's prediction from the measured action costs,
    bubble, where the time goes (``records``: per rank, ``(wall origin, timeline)`` of
    every timed step; ``times``: the step times)."""
    from pipetrain.schedule import TimedAction, simulate
    from pipetrain.trace import aggregate, measure_step, offsets_from_origins

    measures, predicted, ops_by_rank = [], [], []
    predicted_bubble: list[float] = []
    with_sends: list[float] = []
    for rep in range(len(records[0])):
        offsets = offsets_from_origins([records[r][rep][0] for r in range(WORLD_SIZE)])
        timeline = [TimedAction(r, t.action, t.start + offsets[r], t.end + offsets[r])
                    for r in range(WORLD_SIZE) for t in records[r][rep][1]]
        measure = measure_step(timeline, num_ranks=WORLD_SIZE, num_stages=schedule.num_stages)
        measures.append(measure)
        simulated = simulate(schedule, measure.mean_costs)
        predicted.append(simulated.makespan)
        predicted_bubble.append(simulated.bubble_fraction)
        with_sends.append(simulate(schedule, _with_send_costs(measure.mean_costs, timeline,
                                                              schedule.num_stages)).makespan)
        totals: list[dict[str, float]] = [{} for _ in range(WORLD_SIZE)]
        for t in timeline:
            op = t.action.op.value
            totals[t.rank][op] = totals[t.rank].get(op, 0.0) + (t.end - t.start)
        ops_by_rank.append(totals)
    result = aggregate(measures)
    makespans = [m.makespan for m in measures]
    gaps = [m / p - 1.0 for m, p in zip(makespans, predicted)]
    op_names = sorted({op for rep in ops_by_rank for totals in rep for op in totals})
    op_medians = [{op: median([rep[r].get(op, 0.0) for rep in ops_by_rank]) for op in op_names}
                  for r in range(WORLD_SIZE)]
    costs = result.mean_costs.per_stage(schedule.num_stages)
    return {
        "measured_makespan_s": median(makespans),
        "predicted_makespan_s": median(predicted),
        "gap": median(makespans) / median(predicted) - 1.0,
        "median_gap_per_step": median(gaps),
        "outside_actions_s": median([s - m for s, m in zip(times, makespans)]),
        "predicted_with_send_costs_s": median(with_sends),
        "gap_with_send_costs": median(makespans) / median(with_sends) - 1.0,
        "bubble_measured": result.bubble_fraction,
        "bubble_predicted": median(predicted_bubble),
        "busy_s_per_rank": list(result.busy),
        "wait_s_per_rank": list(result.wait),
        "op_seconds_per_rank": op_medians,
        "measured_costs_s": {
            "forward": list(costs.forward), "backward": list(costs.backward),
            "backward_input": list(costs.backward_input),
            "backward_weight": list(costs.backward_weight),
            "communication": list(costs.communication), "step": list(costs.step),
        },
    }


def _with_send_costs(costs: Any, timeline: Sequence[Any], num_stages: int) -> Any:
    """``costs`` with each stage's mean send time (SF, SB: packing and posting a message on
    the sender, which the simulator counts as free) added to the compute that precedes it."""
    from pipetrain.schedule import Costs, Op

    per_stage = costs.per_stage(num_stages)
    sends: dict[Op, list[list[float]]] = {Op.SEND_FORWARD: [[] for _ in range(num_stages)],
                                          Op.SEND_BACKWARD: [[] for _ in range(num_stages)]}
    for t in timeline:
        if t.action.op in sends:
            sends[t.action.op][t.action.stage].append(t.end - t.start)
    sf = [statistics.fmean(v) if v else 0.0 for v in sends[Op.SEND_FORWARD]]
    sb = [statistics.fmean(v) if v else 0.0 for v in sends[Op.SEND_BACKWARD]]
    return Costs(
        forward=tuple(f + s for f, s in zip(per_stage.forward, sf)),
        backward=tuple(b + s for b, s in zip(per_stage.backward, sb)),
        backward_input=tuple(b + s for b, s in zip(per_stage.backward_input, sb)),
        backward_weight=per_stage.backward_weight,
        communication=per_stage.communication,
        reduce=per_stage.reduce,
        step=per_stage.step,
    )


def _torch_schedule(label: str, info: Mapping[str, Any], gathered: Sequence[Any],
                    microbatches: int) -> tuple[Any, dict[str, Any]]:
    """torch's order as a pipetrain schedule, and whether it is pipetrain's order."""
    from pipetrain.schedule import build_schedule, default_stages_per_rank

    order = info["compute_order"]
    if label in gathered[0]["records"]:
        # what torch actually ran (its single-stage schedules do not run their
        # pipeline_order, which can be off: Schedule1F1B's lists micro-batch M)
        order = [[(t.action.op.value, t.action.stage, t.action.microbatch)
                  for t in g["records"][label][0][1] if t.action.op.is_compute]
                 for g in gathered]
    try:
        schedule = torch_schedule_as_pipetrain(order, name=label, num_microbatches=microbatches,
                                               stage_to_rank=info["stage_to_rank"])
        ours = build_schedule(
            info["schedule"], num_ranks=WORLD_SIZE, num_microbatches=microbatches,
            stages_per_rank=default_stages_per_rank(info["schedule"]),
            optimizer_step=True, reduce=True)
    except Exception as exc:
        return None, {"ideal_error": f"{type(exc).__name__}: {exc}"}
    same = (info["num_stages"] == ours.num_stages
            and [[a for a in acts if a.op.is_compute] for acts in schedule.actions]
            == [[a for a in acts if a.op.is_compute] for acts in ours.actions])
    return schedule, {"same_order_as_pipetrain": same}


def runner_rows(runners: Mapping[str, Mapping[str, Any]], gathered: Sequence[Any],
                ideal_costs: Callable[[Mapping[str, Any]], Mapping[str, Sequence[float]] | None],
                microbatches: int, *,
                other_ideals: Mapping[str, Callable[[Mapping[str, Any]],
                                                    Mapping[str, Sequence[float]] | None]]
                | None = None) -> dict[str, dict[str, Any]]:
    """One row per runner: step times, CPU, timeline analysis, ideal step (``ideal_costs``:
    the per-stage costs of a runner's ideal, from what :func:`time_runners` says it ran;
    ``gathered``: every rank's ``samples``, ``records`` and ``scale_seconds``;
    ``other_ideals``: more yardsticks, each row's ideal step under them by key)."""
    rows: dict[str, dict[str, Any]] = {}
    samples = [g["samples"] for g in gathered]
    for label, info in runners.items():
        times = step_times(samples, label)
        row: dict[str, Any] = {
            "framework": info["framework"], "schedule": info["schedule"],
            "num_stages": info["num_stages"], "stage_to_rank": list(info["stage_to_rank"]),
            **summary(times), "step_s": times, "steps_per_s": 1.0 / median(times),
            "main_thread_cpu_s_per_rank": [median([s.main_cpu_s for s in g[label]])
                                           for g in samples],
            "other_threads_cpu_s_per_rank": [median([s.other_cpu_s for s in g[label]])
                                             for g in samples],
        }
        records = [g["records"].get(label) for g in gathered]
        if info["framework"] == "pipetrain":
            schedule = info["pipeline_schedule"]
        else:
            schedule, extra = _torch_schedule(label, info, gathered, microbatches)
            row.update(extra)
        if schedule is not None and all(records):
            row.update(timeline_analysis(records, schedule, times))
            if info["framework"] == "torch":
                row["scale_grads_s"] = median([max(g["scale_seconds"][label][k] for g in gathered)
                                               for k in range(len(times))])
        costs = ideal_costs(info)
        if schedule is not None and costs is not None:
            row.update(ideal(schedule, costs))
            row["over_ideal"] = row["median_s"] / row["ideal_s"] - 1.0
            row["over_floor"] = row["median_s"] / row["floor_s"] - 1.0
        for key, costs_of in (other_ideals or {}).items():
            other = costs_of(info)
            if schedule is not None and other is not None:
                row[key] = ideal(schedule, other)["ideal_s"]
        rows[label] = row
    return rows


def compare(rows: Mapping[str, dict[str, Any]], schedules: Sequence[str],
            failures: Mapping[str, str], first_losses: Mapping[str, list[float]],
            reference: Sequence[float] | None) -> dict[str, Any]:
    """Per schedule: pipetrain's row, torch's rows, the ratios against the fastest torch
    variant, and whether the first losses agree."""
    per_schedule: dict[str, Any] = {}
    for schedule in schedules:
        ours = rows.get(schedule)
        torch_rows = {label: r for label, r in rows.items()
                      if r["framework"] == "torch" and r["schedule"] == schedule}
        variants = {v[0] for v in TORCH_VARIANTS[schedule]}
        entry: dict[str, Any] = {"pipetrain": ours, "torch": torch_rows,
                                 "torch_not_comparable": {label: reason for label, reason
                                                          in failures.items() if label in variants}}
        ours_losses = first_losses.get(f"pipetrain:{schedule}")
        entry["first_losses"] = {"pipetrain": ours_losses,
                                 **{label: first_losses[label] for label in torch_rows
                                    if label in first_losses}}
        entry["max_loss_diff_vs_torch"] = {
            label: max(abs(a - b) for a, b in zip(ours_losses, first_losses[label]))
            for label in torch_rows if ours_losses is not None and label in first_losses}
        if ours_losses is not None and reference is not None:
            entry["max_loss_diff_vs_single_process"] = max(
                abs(a - b) for a, b in zip(ours_losses, reference))
        if ours is not None and torch_rows:
            best_label = min(torch_rows, key=lambda label: torch_rows[label]["median_s"])
            best = torch_rows[best_label]
            entry["torch_best"] = best_label
            entry["ratio"] = best["median_s"] / ours["median_s"]
            entry["ratios"] = {label: r["median_s"] / ours["median_s"]
                               for label, r in torch_rows.items()}
            if "ideal_s" in ours:
                # the best ratio pipetrain could reach with zero overhead (its step = ideal)
                entry["ratio_bound"] = best["median_s"] / ours["ideal_s"]
        per_schedule[schedule] = entry
    return per_schedule
