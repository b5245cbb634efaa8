"""Case ``async_convergence``: its runs, the sweep's recipe, its tables and pictures on
tiny inputs, and (2 ranks, 2 steps) that each runner is evaluated on the weights its
checkpoint saves."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from helpers.distributed import run_workers
from pipetrain.bench.case import Table
from pipetrain.bench.cases import async_convergence
from pipetrain.bench.cases.async_convergence import (
    FULL,
    QUICK,
    Options,
    draw,
    recipe,
    settings,
    summarize,
    tables,
)
from pipetrain.bench.cases.async_convergence_runs import RUNNERS, job


def test_every_runner_and_the_equal_1f1b_are_run_at_both_sizes() -> None:
    for options in (QUICK, FULL):
        assert options.runners == ("1f1b", "1f1b-untied", "pipedream", "2bw")
        assert len(options.sweep_lrs) >= 2
    assert RUNNERS["1f1b"].tied and RUNNERS["1f1b"].clipped
    for name in ("1f1b-untied", "pipedream", "2bw"):
        assert not RUNNERS[name].tied and not RUNNERS[name].clipped, name
    assert RUNNERS["1f1b-untied"].schedule == "1f1b"
    assert len(FULL.sweep_steps) >= 2 and QUICK.steps < FULL.steps


def test_the_sweep_reuses_the_comparisons_run_and_scales_the_warm_up() -> None:
    runs = settings(FULL)
    assert runs[0].runners == FULL.runners and (runs[0].steps, runs[0].lr) == (300, 1e-2)
    points = {(s.steps, s.lr) for s in runs[1:]}
    assert len(runs) - 1 == len(points) == len(FULL.sweep_steps) * len(FULL.sweep_lrs) - 1
    assert (300, 1e-2) not in points
    assert all(s.runners == ("1f1b-untied", "2bw") for s in runs[1:])
    assert {s.steps: s.warmup for s in runs} == {300: 50, 100: 17}
    alone = settings(replace(FULL, runners=("1f1b", "pipedream")))
    assert (300, 1e-2) in {(s.steps, s.lr) for s in alone[1:]}


def test_options_report_every_mistake_at_once() -> None:
    with pytest.raises(ValueError) as error:
        Options(runners=("2bw", "gpipe"), batch_size=12, steps=0)
    message = str(error.value)
    assert "unknown runners ['gpipe']" in message
    assert "batch_size=12 is not a multiple of microbatches=8, e.g. batch_size=16" in message
    assert "steps=0 must be a positive int" in message


def test_the_recipe_holds_for_every_setting_with_more_steps_and_a_lower_lr() -> None:
    gaps = {(100, 1e-2): 0.30, (100, 1e-3): 0.015, (300, 1e-2): 0.10, (300, 1e-3): 0.01,
            (100, 3e-3): 0.05, (300, 3e-3): 0.019}
    assert recipe(gaps, 0.02) == (100, 1e-3)
    # a lower LR that misses the threshold at more steps rules out every setting above it
    assert recipe({**gaps, (300, 1e-3): 0.021}, 0.02) is None
    assert recipe({**gaps, (100, 1e-3): 0.03}, 0.02) == (300, 3e-3)
    assert recipe({(100, 1e-3): -0.01}, 0.02) == (100, 1e-3)  # 2BW better: within
    assert recipe({}, 0.02) is None


def _result(gaps: dict[tuple[int, float], float], options: Options) -> dict[str, Any]:
    """A job's result: the comparison (val 2.0 for 1f1b-untied) and the sweep's runs."""
    runs = []
    for k, setting in enumerate(settings(options)):
        steps = setting.steps
        val = {name: 2.0 for name in setting.runners}
        val["2bw"] = 2.0 * (1 + gaps[(steps, setting.lr)])
        if k == 0:
            val["1f1b"] = 1.9
        runs.append({"seconds": {n: [0.1 if n == "2bw" else 0.12] * steps for n in setting.runners},
                     "losses": {n: [3.0 - 0.01 * t for t in range(steps)] for n in setting.runners},
                     "val": val, "own_eval": {n: v + 0.01 for n, v in val.items()} if k == 0 else {}})
    return {"runs": runs}


OPTIONS = Options(steps=30, warmup=5, skip=1, sweep_steps=(10, 30), sweep_lrs=(1e-2, 1e-3))
GAPS = {(10, 1e-2): 0.2, (10, 1e-3): 0.03, (30, 1e-2): 0.05, (30, 1e-3): 0.015}


def test_the_tables_compare_with_1f1b_untied_and_mark_the_recipe() -> None:
    summary = summarize(_result(GAPS, OPTIONS), OPTIONS)
    assert summary["recipe"] == {"steps": 30, "lr": 1e-3}
    convergence, sweep = tables(summary, OPTIONS)
    assert (convergence.key, sweep.key) == ("convergence", "gap_sweep")
    assert convergence.columns == [
        "schedule", "embeddings", "clip", "median step ms", "throughput / 1f1b-untied",
        "train loss (last tenth)", "val loss", "val loss / 1f1b-untied", "val loss / 1f1b"]
    rows = {row[0]: row for row in convergence.rows}
    assert list(rows) == ["1f1b", "1f1b-untied", "pipedream", "2bw"]
    assert rows["1f1b"][1:3] == ["tied", 1.0] and rows["2bw"][1:3] == ["untied", "-"]
    assert rows["2bw"][4] == 1.2 and rows["2bw"][7] == 1.05 and rows["1f1b"][8] == 1.0
    assert "W(T)" in convergence.notes and "checkpoint" in convergence.notes
    assert sweep.columns == ["steps", "warm-up", "peak LR", "1f1b-untied val loss",
                             "2bw val loss", "2bw gap", "within 2%"]
    assert [row[:3] + row[5:] for row in sweep.rows] == [
        [10, 2, 0.01, "+20.0%", "no"], [10, 2, 0.001, "+3.0%", "no"],
        [30, 5, 0.01, "+5.0%", "no"], [30, 5, 0.001, "+1.5%", "yes: the recipe"]]
    none = summarize(_result({**GAPS, (30, 1e-3): 0.025}, OPTIONS), OPTIONS)
    assert none["recipe"] is None
    assert "no recipe on this grid" in tables(none, OPTIONS)[1].notes


def test_the_pictures_are_drawn_from_the_recorded_tables_and_data(tmp_path: Path) -> None:
    summary = summarize(_result(GAPS, OPTIONS), OPTIONS)
    recorded = json.loads(json.dumps({"tables": [t.to_dict() for t in tables(summary, OPTIONS)],
                                      "data": summary}))
    names = draw([Table.from_dict(t) for t in recorded["tables"]], recorded["data"], tmp_path)
    assert names == ["async_convergence_gap.png", "async_convergence_loss.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in names)
    assert draw([], {}, tmp_path) == []
    assert async_convergence.CASE.draw is draw


def test_each_runner_is_evaluated_on_the_weights_its_checkpoint_saves(tmp_path: Path) -> None:
    """1f1b-untied's checkpoint holds the weights its own evaluation uses; 2bw's holds
    W(T), not the W(T - 1) its own evaluation uses."""
    options = Options(steps=2, warmup=1, batch_size=8, val_batches=1,
                      runners=("1f1b-untied", "2bw"), sweep_steps=(2,), sweep_lrs=(1e-2,))
    result = run_workers(job, 2, options, settings(options), str(tmp_path), timeout=300)[0]
    run = result["runs"][0]
    assert run["val"]["1f1b-untied"] == pytest.approx(run["own_eval"]["1f1b-untied"], abs=1e-6)
    assert abs(run["val"]["2bw"] - run["own_eval"]["2bw"]) > 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the checkpoints are removed
