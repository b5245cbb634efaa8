"""The gpipe_table1 bench case on tiny sizes: the search against fake caps, the paper's
rows, the tables from given search results, and one real trial that the watchdog ends."""

from __future__ import annotations

import doctest
import importlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench.case import BenchContext
from pipetrain.bench.cases import gpipe_table1
from pipetrain.bench.cases._gpipe_memory import Workload, trial_worker
from pipetrain.bench.cases._gpipe_search import largest_fitting
from pipetrain.bench.harness import run_job
from pipetrain.launch import ProcessesFailed


@pytest.mark.parametrize("name", ["_gpipe_search", "_gpipe_memory", "gpipe_table1"])
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipetrain.bench.cases.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("largest", [0, 1, 2, 13, 64, 100, 999])
@pytest.mark.parametrize("start", [1, 4, 50, 1000])
def test_search_finds_the_largest_fitting_size(largest: int, start: int) -> None:
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= largest

    found = largest_fitting(fits, start=start, limit=1000)
    assert found.largest == largest
    assert found.first_too_large == largest + 1
    assert found.complete
    assert [n for n, _ in found.trials] == calls
    assert len(set(calls)) == len(calls)  # no size is tried twice
    assert len(calls) <= 2 * 11  # doubling or halving, then bisection: logarithmic


def test_search_stops_at_the_tolerance_and_at_the_limit() -> None:
    found = largest_fitting(lambda n: n <= 300, start=8, limit=4096, tolerance=1 / 16)
    assert 300 - 300 // 16 <= found.largest <= 300
    assert found.first_too_large is not None and found.first_too_large - found.largest <= 300 // 16
    everything = largest_fitting(lambda n: True, start=3, limit=20)
    assert everything.largest == 20 and everything.first_too_large is None
    assert [n for n, _ in everything.trials] == [3, 6, 12, 20]


def test_search_stops_with_the_reason() -> None:
    failures: list[str] = []

    def fits(n: int) -> bool:
        if n >= 8:
            failures.append(f"the trial of {n} blocks failed")
        return True

    found = largest_fitting(fits, limit=100, stop=lambda: failures[0] if failures else None)
    assert found.stopped == "the trial of 8 blocks failed" and not found.complete
    assert found.largest == 8 and [n for n, _ in found.trials] == [1, 2, 4, 8]
    late = largest_fitting(lambda n: True, limit=100, deadline=time.monotonic() - 1)
    assert late.stopped == "out of time" and late.trials == []
    with pytest.raises(ValueError, match="start=0"):
        largest_fitting(lambda n: True, start=0, limit=10)


def test_paper_rows_are_table_1_of_the_paper() -> None:
    rows = {row[0]: row for row in gpipe_table1.paper_rows()}
    assert list(rows) == ["naive-1", "pipeline-1", "pipeline-2", "pipeline-4", "pipeline-8"]
    assert [rows[k][1] for k in rows] == ["282.2M", "785.8M", "1.3B", "3.0B", "5.3B"]
    assert [rows[k][3] for k in rows] == ["82M", "318M", "542M", "1.05B", "1.8B"]
    assert rows["naive-1"][2] == "1.00x" and rows["pipeline-8"][4] == "21.95x"


def _fake_search(largest: int, per_block: float) -> dict[str, Any]:
    depths = sorted({max(1, largest // 2), largest})
    return {"kind": "fake",
            "search": {"largest": largest, "first_too_large": largest + 1,
                       "trials": [[d, True] for d in depths] + [[largest + 1, False]],
                       "stopped": None},
            "records": [{"depth": d, "fits": True, "peak_mib": [5.0 + per_block * d]}
                        for d in depths] + [{"depth": largest + 1, "fits": False,
                                             "killed_above_mib": 24.5}]}


@pytest.mark.parametrize("pipe4, met, fsdp_met", [(40, "yes", "no"), (30, "no", "yes")])
def test_tables_from_given_searches(monkeypatch: pytest.MonkeyPatch, pipe4: int,
                                    met: str, fsdp_met: str) -> None:
    found = [_fake_search(4, 4.0), _fake_search(10, 1.8), _fake_search(10, 1.9),
             _fake_search(20, 1.9), _fake_search(pipe4, 1.9), _fake_search(80, 1.9),
             _fake_search(72, 1.0)]
    monkeypatch.setattr(gpipe_table1, "_quick_searches", lambda context, sizes: found)
    with tempfile.TemporaryDirectory() as out:
        result = gpipe_table1.run(BenchContext(quick=True, out=Path(out),
                                               progress=lambda line: None))
    sizes, shape = result.tables
    labels = [row[0] for row in sizes.rows]
    assert labels == [r.label for r in gpipe_table1.RUNNERS]
    work = gpipe_table1.SIZES["quick"]["work"]
    assert sizes.rows[0][4] == f"{work.parameters(4) / 1e6:.4g}M" and sizes.rows[0][5] == "1.00x"
    assert sizes.rows[1][7] == pytest.approx(1.8)  # MiB per block: the slope of the peaks
    assert sizes.rows[5][3] == "80" and sizes.rows[5][8] == "5.3B"
    assert sizes.rows[6][8] == "-"  # K = 4 x FSDP 2: no row of the paper
    # what each row re-materializes: GPipe's single partition and Pipeline's K = 1 alike,
    # the K >= 2 rows (FSDP's included, against K = 4) layer by layer
    assert [row[2] for row in sizes.rows] == ["-", "always", "always"] + ["per_layer"] * 4
    checks = {row[0]: row for row in shape.rows}
    fsdp = checks["K = 4 x FSDP 2 over K = 4, both Pipeline"]
    assert fsdp[1] == f"{work.parameters(72) / work.parameters(pipe4):.2f}x"
    # 72 blocks are 1.8x of 40 blocks, less in parameters (the embedding and head are fixed)
    assert fsdp[2] == ">= 1.8x" and fsdp[4].startswith(fsdp_met)
    remat = checks["re-materialization alone: pipeline-1 (GPipe) / naive-1"]
    assert remat[1] == f"{work.parameters(10) / work.parameters(4):.2f}x" and remat[4] == "yes"
    assert checks["K = 4 over K = 1, both Pipeline"][4].startswith(met)
    assert result.data["runners"][4]["parameters"] == work.parameters(pipe4)


def test_runners_left_out_of_the_quick_run_are_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    skipped = {"kind": "pipeline", "records": [],
               "search": {"largest": 0, "first_too_large": None, "trials": [],
                          "stopped": "full run only"}}
    found = [_fake_search(4, 4.0), _fake_search(10, 1.8), _fake_search(10, 1.9),
             _fake_search(20, 1.9), skipped, skipped, skipped]
    monkeypatch.setattr(gpipe_table1, "_quick_searches", lambda context, sizes: found)
    with tempfile.TemporaryDirectory() as out:
        result = gpipe_table1.run(BenchContext(quick=True, out=Path(out),
                                               progress=lambda line: None))
    sizes, shape = result.tables
    assert sizes.rows[4][3:6] == ["not run (full run only)", "-", "-"]
    checks = {row[0]: row for row in shape.rows}
    assert checks["K = 4 over K = 1, both Pipeline"][1:] == [
        "-", ">= 3.6x", "3.82x", "not run (full run only)"]
    work = gpipe_table1.SIZES["quick"]["work"]
    expected = work.parameters(20) / work.parameters(10)
    assert checks["K = 2 over K = 1, both Pipeline"][1] == f"{expected:.2f}x"
    assert result.data["runners"][4]["parameters"] is None
    assert len(gpipe_table1.SIZES["quick"]["starts"]) == sum(
        r.workers <= gpipe_table1.SIZES["quick"]["max_workers"] for r in gpipe_table1.RUNNERS)


@pytest.mark.distributed
def test_a_trial_past_the_cap_is_ended_by_the_watchdog() -> None:
    work = Workload(width=32, heads=2, context=16, batch=4, microbatches=2)
    fitting = run_job(trial_worker, "naive", 2, work, 64.0, tempfile.gettempdir(),
                      world_size=1, timeout=120)
    assert 0 < fitting[0]["peak_mib"] <= 64.0
    with tempfile.TemporaryDirectory() as marks:
        with pytest.raises(ProcessesFailed):
            run_job(trial_worker, "pipeline", 400, work, 4.0, marks, world_size=2, timeout=120)
        killed = [float(p.read_text()) for p in Path(marks).glob("*.killed")]
    assert killed and all(mib > 4.0 for mib in killed)


def test_the_quick_jobs_leave_the_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls: list[tuple[str, ...]] = []

    def fake_run_job(fn: Any, kinds: list[str], *args: Any, world_size: int,
                     **kwargs: Any) -> list[Any]:
        os.environ["OMP_NUM_THREADS"] = "1"  # as run_job does around its spawn
        calls.append(tuple(kinds))
        return [[_fake_search(4 * world_size, 1.0) for _ in kinds]]

    monkeypatch.setattr(gpipe_table1, "run_job", fake_run_job)
    sizes = gpipe_table1.SIZES["quick"]
    found = gpipe_table1._quick_searches(BenchContext(quick=True, out=Path("."),
                                                      progress=lambda line: None), sizes)
    assert "OMP_NUM_THREADS" not in os.environ
    assert sorted(calls) == [("naive", "gpipe", "pipeline"), ("pipeline-per-layer",)]
    assert [f["search"]["largest"] for f in found] == [4, 4, 4, 8, 0, 0, 0]
    assert all(f["search"]["stopped"] == "full run only" for f in found[4:])


@pytest.mark.parametrize("largest", [31, 127, 130])
def test_a_search_held_to_a_ratio_starts_at_its_goal_in_parameters(largest: int) -> None:
    """The K = 4 x FSDP 2 search starts at the fewest blocks with 1.8x the parameters of
    K = 4's largest model (the embedding and head make that more than 1.8x the blocks)."""
    parameters = gpipe_table1.SIZES["full"]["work"].parameters
    start_from = gpipe_table1.RUNNERS[-1].start_from
    assert start_from is not None and gpipe_table1.RUNNERS[start_from[0]].workers == 4
    factor = start_from[1]
    start = gpipe_table1.search_start(parameters, largest, factor)
    goal = factor * parameters(largest)
    assert parameters(start) >= goal > parameters(start - 1)
    assert start > largest * factor


def test_what_a_pipeline_worker_holds_beyond_gpipe_is_measured_at_one_size() -> None:
    """The note compares the two single-worker runners at one size (medians), in buffers
    of one block's parameters per block; without that measurement it says so."""
    same = {"depth": 20, "peaks_mib": {"gpipe": [100.0, 104.0, 101.0],
                                       "pipeline": [99.0, 100.5, 98.0]}}
    note = gpipe_table1._buffers_note(same, 0.75)
    assert "20 blocks" in note
    assert "peaks at 99.0 MiB against 101.0" in note
    assert f"{(99.0 - 101.0) / 20 / 0.75:+.2f} parameter-sized buffers per block" in note
    assert "within 4.0 MiB" in note
    assert "full run only" in gpipe_table1._buffers_note(None, 0.75)
    assert "could not" in gpipe_table1._buffers_note(
        {"depth": 20, "peaks_mib": {"gpipe": [], "pipeline": [99.0]}}, 0.75)


def test_a_full_run_measures_both_single_worker_rows_at_the_smaller_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found = [_fake_search(4, 4.0), _fake_search(12, 1.8), _fake_search(10, 1.9),
             _fake_search(20, 1.9), _fake_search(40, 1.9), _fake_search(80, 1.9),
             _fake_search(72, 1.0)]
    asked = []

    def peaks(kinds, depth, work, *, repeats, timeout):  # type: ignore[no-untyped-def]
        asked.append((tuple(kinds), depth, repeats))
        return {"gpipe": [50.0, 51.0, 52.0], "pipeline": [51.0, 52.0, 53.0]}

    monkeypatch.setattr(gpipe_table1, "_full_searches", lambda context, sizes: found)
    monkeypatch.setattr(gpipe_table1, "same_size_peaks", peaks)
    with tempfile.TemporaryDirectory() as out:
        result = gpipe_table1.run(BenchContext(quick=False, out=Path(out),
                                               progress=lambda line: None))
    assert asked == [(("gpipe", "pipeline"), 10, 3)]  # the smaller of 12 and 10 blocks
    assert result.data["same_size"]["depth"] == 10
    assert "peaks at 52.0 MiB against 51.0" in result.tables[1].notes
