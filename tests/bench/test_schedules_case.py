"""The schedules bench case: the simulation against the analytic bubble and known memory,
the table from given measurements (no processes), its pictures, and (a few seconds, 2
processes) the whole case at its quick size."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench.cases import schedules
from pipetrain.bench.cases._schedules_sim import (
    SCHEDULES,
    ModelCosts,
    analytic_bubble,
    peak_activation_bytes,
    simulate_schedule,
    stage_balance,
)
from pipetrain.bench.cases._schedules_table import COLUMNS, draw_schedules, schedules_table
from pipetrain.bench.harness import Sample, dump_json
from pipetrain.schedule import build_schedule, simulate

EVERY = {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zb-v",
         "v-half", "v-min", "dualpipe-v", "pipedream", "2bw"}


@pytest.mark.parametrize("name", ["_schedules_sim", "_schedules_runs", "_schedules_table",
                                  "schedules"])
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipetrain.bench.cases.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_every_schedule_is_in_the_case() -> None:
    assert set(SCHEDULES) == EVERY


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_layers_give_the_analytic_bubble(name: str, k: int) -> None:
    costs = ModelCosts.uniform(16, forward=1.0, backward=2.0, activation_bytes=100)
    result = simulate_schedule(name, costs, num_ranks=k, num_microbatches=4 * k)
    assert result.bubble == pytest.approx(analytic_bubble(k, 4 * k), rel=1e-12)
    assert result.makespan_s == pytest.approx((4 * k + k - 1) * 3.0 * 16 / k)
    assert result.balance == (16 // k,) * k
    # gpipe holds all M micro-batches on every rank, 1f1b K on the first
    assert result.peak_held == (4 * k if name == "gpipe" else k)
    assert result.peak_bytes == result.peak_held * 100 * (16 // k)


def test_the_other_schedules_beat_the_bubble_of_1f1b_with_equal_layers() -> None:
    costs = ModelCosts.uniform(16, forward=1.0, backward=2.0)
    for k in (2, 4, 8):
        one_f_one_b = simulate_schedule("1f1b", costs, num_ranks=k, num_microbatches=4 * k)
        for name in ("interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"):
            other = simulate_schedule(name, costs, num_ranks=k, num_microbatches=4 * k)
            assert other.bubble < one_f_one_b.bubble, (name, k)
            assert other.makespan_s < one_f_one_b.makespan_s, (name, k)
        assert simulate_schedule("zb-v", costs, num_ranks=k, num_microbatches=4 * k
                                 ).num_stages == 2 * k


def test_weight_versions_and_the_asynchronous_steady_step() -> None:
    costs = ModelCosts.uniform(16, forward=1.0, backward=2.0)
    for k in (2, 4, 8):
        pipedream = simulate_schedule("pipedream", costs, num_ranks=k, num_microbatches=4 * k)
        two_bw = simulate_schedule("2bw", costs, num_ranks=k, num_microbatches=4 * k)
        flushed = simulate_schedule("1f1b", costs, num_ranks=k, num_microbatches=4 * k)
        assert (pipedream.weight_versions, two_bw.weight_versions, flushed.weight_versions) \
            == (k, 2, 1)
        # free streaming: one micro-batch per stage's forward + backward
        assert pipedream.stream_s_per_microbatch == pytest.approx(3.0 * 16 / k)
        assert flushed.stream_s_per_microbatch is None
        # no fill and drain in the steady step: shorter than a flushed step
        assert two_bw.makespan_s < flushed.makespan_s


def test_activation_bytes_follow_each_stage_and_the_split_backward() -> None:
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=3, communication=False)
    assert peak_activation_bytes(schedule, [5, 7]) == (15, 21)
    split = build_schedule("zb-h1", num_ranks=2, num_microbatches=4, communication=False)
    held = peak_activation_bytes(split, [1, 1])
    assert held == simulate(split).peak_activations == (2, 2)  # the last rank holds until W


def test_mistakes_are_reported() -> None:
    with pytest.raises(ValueError, match="one value per layer"):
        ModelCosts(forward=(1.0,), backward=(1.0, 2.0), backward_input=(1.0,),
                   backward_weight=(1.0,), step=(0.0,), activation_bytes=(0,))
    with pytest.raises(ValueError, match="16 stages need at least 16 layers, the model has 8"):
        stage_balance(ModelCosts.uniform(8, forward=1.0, backward=2.0), 16)


def _raw(costs: ModelCosts, times: dict[str, list[float]]) -> dict[str, Any]:
    """What rank 0 of the job returns, for given step times (no recorded actions)."""
    samples = [{f"MLP {s}": [Sample(t, 0.0, 0.0) for t in ts] for s, ts in times.items()}
               for _ in range(2)]
    runners = {f"MLP {s}": {"framework": "pipetrain", "schedule": s, "num_stages": 2,
                            "stage_to_rank": [0, 1], "pipeline_schedule": None} for s in times}
    return {"profiles": {"MLP": dataclasses.asdict(costs)}, "balances": {},
            "first_losses": {f"pipetrain:MLP {s}": [1.0, 0.5] for s in times},
            "failures": {"MLP zb-v": "first step failed: boom"},
            "gathered": [{"samples": s, "records": {},
                          "cpu_window": {"wall_s": 1.0, "machine_busy_s": 1.0, "own_cpu_s": 0.5}}
                         for s in samples],
            "runners": runners}


def test_the_table_from_given_measurements(tmp_path: Path) -> None:
    costs = ModelCosts.uniform(16, forward=1e-3, backward=2e-3, activation_bytes=1 << 20)
    times = {s: [0.040, 0.050, 0.045] for s in SCHEDULES if s != "zb-v"}
    times["1f1b"] = [0.030, 0.031, 0.029]
    sizes = dataclasses.replace(schedules.SIZES["quick"],
                                specs=schedules.SIZES["quick"].specs[:1])
    data = schedules.analyse(_raw(costs, times), sizes)
    table = schedules_table(data)
    assert table.columns == COLUMNS
    assert [(row[1], row[2]) for row in table.rows] == [
        (k, s) for k in schedules.KS for s in SCHEDULES]
    assert all(len(row) == len(COLUMNS) for row in table.rows)
    rows = {(row[1], row[2]): dict(zip(COLUMNS, row)) for row in table.rows}
    one = rows[(2, "1f1b")]
    simulated = (8 + 1) * 3e-3 * 8  # M = 8, K = 2, 8 equal layers per stage
    assert one["measured ms"] == 30.0 and one["simulated ms"] == pytest.approx(1e3 * simulated)
    assert one["measured vs simulated"] == f"{100 * (0.030 / simulated - 1):+.1f}%"
    assert one["throughput vs best"] == 1.0 and rows[(2, "gpipe")]["throughput vs best"] == 0.667
    assert one["samples/s"] == round(8 * 4 / 0.030, 1)  # M x 4 samples per micro-batch
    assert one["bubble simulated"] == f"{analytic_bubble(2, 8):.1%}"
    assert rows[(2, "zb-v")]["measured ms"] is None  # its failure is in the notes instead
    assert "MLP zb-v: first step failed: boom" in table.notes
    for k in schedules.KS:  # the best of each K is 1.0
        assert max(rows[(k, s)]["throughput vs best"] or 0.0 for s in SCHEDULES) == 1.0
        # all M = 4K micro-batches of a stage of 16 / K layers of 1 MiB each
        assert rows[(k, "gpipe")]["peak activations MiB"] == 64.0
    assert rows[(8, "pipedream")]["weight versions"] == 8
    assert "measured steps" in table.notes and "largest difference: MLP 0.0e+00" in table.notes
    assert table.anchor and "simulat" in table.anchor
    assert "16 x [Linear(128, 128) + GELU]" in table.notes
    # as a result file holds them: the same table, and the pictures drawn from it
    recorded = json.loads(dump_json(data))
    assert schedules_table(recorded).rows == json.loads(dump_json(table.rows))
    names = draw_schedules([table], recorded, tmp_path)
    assert names == ["schedules_mlp.png"] and (tmp_path / names[0]).stat().st_size > 0
