"""The cases ported from the old benchmark scripts: their logic on tiny inputs (settings
validated, the fastest anchor chosen, tables built from results, skips and refusals),
without running them at size (``test_suite.py`` runs them all at ``--quick`` size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench import gpipe_runs, registry
from pipetrain.bench.case import BenchContext, SkipCase
from pipetrain.bench.cases import (
    async_convergence,
    frontend_meta_memory,
    gpipe_vs_torchgpipe,
    planner_speed,
    planner_vs_pipedream,
    transport,
    vs_torch_pipelining,
)
from pipetrain.bench.cases.pipedream_traffic import find_profiles
from pipetrain.bench.gpipe_runs import Setting
from pipetrain.bench.vs_torch.analysis import compare
from pipetrain.bench.vs_torch.options import SCHEDULES, Options
from pipetrain.bench.vs_torch.tables import goals, mlp_tables
from pipetrain.plan.optimizer import PlannerConfig
from pipetrain.plan.topology import Topology


def test_the_declared_quick_durations_fit_the_five_minute_budget() -> None:
    cases = [registry.load_case(name) for name in registry.case_names()]
    assert sum(c.quick_seconds for c in cases) < 300
    # the declared full durations: each case's wall time in the last full run (93 min;
    # 82 to 93 min from one run to the next on this machine's shared cores)
    assert sum(c.full_seconds for c in cases) < 100 * 60


def test_quick_sizes_keep_every_schedule_and_runner() -> None:
    assert vs_torch_pipelining.QUICK.schedules == SCHEDULES == vs_torch_pipelining.FULL.schedules
    assert vs_torch_pipelining.QUICK.tf_schedules == ("gpipe", "1f1b")
    assert vs_torch_pipelining.FULL.tf_schedules == SCHEDULES  # every schedule, both models
    assert async_convergence.QUICK.runners == ("1f1b", "1f1b-untied", "pipedream", "2bw")
    assert async_convergence.QUICK.steps < async_convergence.FULL.steps
    assert transport.QUICK.rows == transport.FULL.rows
    assert frontend_meta_memory.FULL.runs == ("init", "safetensors")


def test_the_comparison_options_report_every_mistake_at_once() -> None:
    with pytest.raises(ValueError) as error:
        Options(depth=6, batch=65, schedules=("gpipe", "nope"), tf_balance=(3, 3))
    message = str(error.value)
    assert "unknown schedules ['nope']" in message
    assert "batch 65 is not a multiple of microbatches 8" in message
    assert "tf_balance (3, 3)" in message and "adding up to 10" in message
    assert "depth 6 must be a multiple of 4" in message
    assert Options(tf_balance=(4, 6)).tf_balance == (4, 6)


def test_a_gpipe_setting_whose_balance_misses_layers_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match=r"balance \[4, 3\] sums to 7 but the mlp has 8 layers; "
                                         r"e.g. balance=\(4, 4\)"):
        Setting(balance=(4, 3))
    assert Setting(model="gpt", depth=8, balance=(5, 5)).describe().startswith("GPT: 8 blocks")
    assert [s.memory_only for s in gpipe_vs_torchgpipe.MEMORY_SETTINGS] == [True, True]


class _Answers:
    """A runner's end of the pipe that takes ``ms`` per step."""

    def __init__(self, ms: float) -> None:
        self.ms, self.request = ms, (0, 0)

    def send(self, request: Any) -> None:
        self.request = request

    def poll(self, timeout: float) -> bool:
        return True

    def recv(self) -> list[float]:
        return [self.ms / 1e3] * self.request[1]


@pytest.mark.parametrize(("default_ms", "one_thread_ms", "anchor"),
                         [(12.0, 11.0, "torchgpipe@1"), (9.0, 11.0, "torchgpipe")])
def test_pipetrain_is_compared_with_torchgpipes_faster_thread_count(
        default_ms: float, one_thread_ms: float, anchor: str) -> None:
    setting = Setting(repetitions=4, block=2)
    assert gpipe_runs.runners(setting)[-1] == "torchgpipe@1"
    assert "torchgpipe@1" not in gpipe_runs.runners(Setting(memory_only=True))
    conns = {"pipetrain": _Answers(10.0), "torchgpipe": _Answers(default_ms),
             "plain": _Answers(8.0), "torchgpipe@1": _Answers(one_thread_ms)}
    result = gpipe_runs._time(setting, conns)  # type: ignore[arg-type]
    fastest = min(default_ms, one_thread_ms)
    assert result["torchgpipe_anchor"] == anchor
    assert result["ratio_pipetrain_over_torchgpipe"] == pytest.approx(fastest / 10.0)
    result.update(checkpoint="except_last", torch_threads=2)
    table = gpipe_vs_torchgpipe._time_table([("defaults", setting, result)])
    threads = "1" if anchor.endswith("@1") else "2 (torch's default)"
    assert table.rows == [["defaults", 10.0, fastest, threads, 8.0,
                           round(fastest / 10.0, 2), 0.8]]


def _row(framework: str, schedule: str, median: float) -> dict[str, Any]:
    return {"framework": framework, "schedule": schedule, "median_s": median}


def test_each_schedule_is_compared_with_the_fastest_torch_variant() -> None:
    rows = {"zb-h1": _row("pipetrain", "zb-h1", 1.0),
            "ScheduleInterleavedZeroBubble(V=1)": _row("torch", "zb-h1", 1.5),
            "ScheduleInterleavedZeroBubble(V=2)": _row("torch", "zb-h1", 1.2),
            "gpipe": _row("pipetrain", "gpipe", 2.0)}
    losses = {"pipetrain:zb-h1": [3.0, 2.0], "ScheduleInterleavedZeroBubble(V=1)": [3.0, 2.5],
              "ScheduleInterleavedZeroBubble(V=2)": [3.0, 2.0], "pipetrain:gpipe": [3.0, 2.0]}
    result = compare(rows, ["zb-h1", "gpipe"],
                     {"ScheduleZBVZeroBubble": "ValueError: no", "ScheduleGPipe": "x"},
                     losses, [3.0, 2.25])
    zb = result["zb-h1"]
    assert zb["torch_best"] == "ScheduleInterleavedZeroBubble(V=2)"
    assert zb["ratio"] == pytest.approx(1.2)
    assert zb["ratios"]["ScheduleInterleavedZeroBubble(V=1)"] == pytest.approx(1.5)
    assert zb["torch_not_comparable"] == {"ScheduleZBVZeroBubble": "ValueError: no"}
    assert zb["max_loss_diff_vs_torch"]["ScheduleInterleavedZeroBubble(V=1)"] == 0.5
    assert zb["max_loss_diff_vs_single_process"] == 0.25
    gpipe = result["gpipe"]
    assert "ratio" not in gpipe and gpipe["torch_not_comparable"] == {"ScheduleGPipe": "x"}


def test_the_mlp_tables_name_the_anchor_and_the_goals() -> None:
    ours = {"median_s": 0.1, "predicted_makespan_s": 0.1, "measured_makespan_s": 0.105,
            "gap": 0.05, "bubble_measured": 0.1, "over_ideal": 0.08}
    theirs = {"median_s": 0.13}
    result = {"schedules": {"gpipe": {
        "pipetrain": ours, "torch": {"ScheduleGPipe": theirs}, "torch_best": "ScheduleGPipe",
        "ratio": 1.3, "ratios": {"ScheduleGPipe": 1.3}, "torch_not_comparable": {},
        "max_loss_diff_vs_torch": {"ScheduleGPipe": 0.0},
        "max_loss_diff_vs_single_process": 1e-8}},
        "load_during_timing": {"wall_s": 1.0, "our_cores": 2.0, "other_cores": 0.0},
        "plain_costs_s": {"gpipe": {"stage_to_rank": [0, 1], "forward": [0.001, 0.001],
                                    "backward": [0.002, 0.002], "step": [0.0, 0.0]}}}
    main, ideal = mlp_tables(result, Options())
    assert main.key == "mlp" and ideal.key == "mlp_ideal"
    assert main.rows == [["gpipe", 100.0, 130.0, "ScheduleGPipe", "1.30x", "-", "yes",
                          "+8.0%", "+5.0%", "10.0%", "-"]]
    # what each side ran with
    assert "scale_grads=False" in main.anchor and "set_to_none=False" in main.anchor
    assert [r[0] for r in ideal.rows] == ["pipetrain gpipe", "torch ScheduleGPipe"]
    assert [(g.name, g.met) for g in main.goals] == [
        ("MLP gpipe: pipetrain / torch throughput", True),
        ("MLP gpipe: step vs ideal", False),  # 8% over, the goal is 5%
        ("MLP gpipe: measured vs simulated", True)]
    assert "MLP gpipe: step vs ideal 8.0% (goal <= 5.0%): MISSED" in main.markdown()
    assert goals({"mlp": result}) == {g.name: g.met for g in main.goals}
    assert "gpipe: F [1.00, 1.00] B [2.00, 2.00]" in ideal.notes
    # a step below its ideal (pipetrain's actions faster than plain autograd's) meets it
    ours["over_ideal"] = -0.143
    main, _ = mlp_tables(result, Options())
    assert [(g.name, g.met) for g in main.goals][1] == ("MLP gpipe: step vs ideal", True)


def test_the_meta_memory_table_compares_every_rank_with_the_cap() -> None:
    mib = 2**20
    rank = {"stage_parameter_bytes": 10 * mib, "peak_rss_first_step": 90 * mib,
            "peak_rss": 150 * mib}
    results = {"model_parameter_bytes": 100 * mib, "cap_bytes": 200 * mib,
               "init": [rank, {**rank, "peak_rss": 250 * mib}]}
    table = frontend_meta_memory._table(results, frontend_meta_memory.Options(runs=("init",)))
    assert [row[-3:] for row in table.rows] == [[0.75, True, True], [1.25, False, True]]
    assert "the cap, 200 MiB" in table.anchor


def test_the_planner_speed_rows_count_the_graph() -> None:
    row = planner_speed.plan_timed("chain", planner_speed.chain(12),
                                   PlannerConfig(topology=Topology.flat(4, 1e10)))
    assert row["nodes"] == 12 and row["cuts"] == 13 and row["pairs"] == 13 * 12 // 2  # cut pairs (a, b), a before b
    assert row["workers"] == 4 and row["time_per_step_s"] > 0


def test_planner_vs_pipedream_is_skipped_without_the_profiles(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipetrain.bench.cases import pipedream_traffic

    monkeypatch.setattr(pipedream_traffic, "find_profiles", lambda names: None)
    context = BenchContext(quick=True, out=tmp_path, progress=lambda line: None)
    with pytest.raises(SkipCase, match="PIPETRAIN_PIPEDREAM_PROFILES"):
        planner_vs_pipedream.run(context)


def test_planner_vs_pipedream_refuses_a_checkout_without_its_optimizer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert find_profiles(planner_vs_pipedream.MODELS) is not None  # ../shared/pipedream
    monkeypatch.setenv(planner_vs_pipedream.CHECKOUT_ENV, str(tmp_path))
    context = BenchContext(quick=True, out=tmp_path, progress=lambda line: None)
    with pytest.raises(ValueError, match=r"PIPETRAIN_PIPEDREAM_CHECKOUT=.* has no optimizer/"):
        planner_vs_pipedream.run(context)


def test_planner_vs_pipedream_plans_alexnet_as_pipedream_predicts() -> None:
    folder = find_profiles(planner_vs_pipedream.MODELS)
    assert folder is not None  # ../shared/pipedream, beside every checkout
    assert len(planner_vs_pipedream.CLUSTERS) == 12
    cluster = planner_vs_pipedream.Cluster((4,), (1e9,), False)
    row = planner_vs_pipedream._compare("alexnet", folder / "alexnet" / "graph.txt", cluster,
                                        None)
    # PipeDream's optimizer_graph_hierarchical.py predicts 0.0342171413 s on this profile
    # and cluster ("Time per stage in pipeline"), with 3 replicas of its first stage
    assert row["pipetrain_s"] == pytest.approx(0.0342171413, rel=1e-6)
    assert row["stages"] == "[0-12]x3 [13-21]x1" and row["pipedream_s"] is None


def test_planner_vs_pipedream_records_no_machine_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Bug: its record named /work/shared/pipedream and the optimizer checkout's path."""
    monkeypatch.setattr(planner_vs_pipedream, "MODELS", ("alexnet",))
    monkeypatch.delenv(planner_vs_pipedream.CHECKOUT_ENV, raising=False)
    context = BenchContext(quick=True, out=tmp_path, progress=lambda line: None)
    result = planner_vs_pipedream.run(context)
    assert result.data["profiles"] == "../shared/pipedream"
    assert result.data["pipedream_checkout"] is None
    assert [row[0] for row in result.tables[0].rows] == ["alexnet"] * len(result.tables[0].rows)
    assert str(Path(__file__).resolve().parents[3]) not in repr(result.data)


def test_the_planner_case_puts_its_memory_cap_where_only_recomputation_fits() -> None:
    """The cap lies between the least a per-stage plan needs and the least a plan keeping
    every activation needs: no plan with ``never`` fits, the per-stage plan does, and the
    anchor is the fastest predicted plan of one mode for all."""
    from pipetrain.bench.cases import _planner_memory as planner_memory
    from pipetrain.plan import Plan

    tiny = planner_memory.Options(workers=4, vocab=64, width=16, layers=6, heads=2, context=16,
                                  batch=8, profile_repetitions=1)
    planned = planner_memory._plan_under_cap(tiny, 4, 1e9)
    assert planned["lowest"] < planned["cap"] < planned["without"]
    steps = planned["uniform_steps"]
    assert steps["never"] is None and any(steps[m] is not None
                                          for m in ("except_last", "always", "per_layer"))
    per_stage, anchor = (Plan.from_dict(planned[name]) for name in planned["names"])
    assert max(s.memory_per_worker for s in per_stage.stages) <= planned["cap"]
    assert max(s.memory_per_worker for s in anchor.stages) <= planned["cap"]
    assert anchor.time_per_step == min(s for s in steps.values() if s is not None)
    assert per_stage.time_per_step <= anchor.time_per_step
    assert [s.replicas for s in per_stage.stages] == [1, 1, 1, 1]


@pytest.mark.parametrize("name", ["_planner_runs", "_planner_memory"])
def test_the_planner_case_modules_examples(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"pipetrain.bench.cases.{name}"))
    assert result.attempted > 0 and result.failed == 0
