"""pipetrain.bench.redraw, and the suite drawing a case's pictures after it ran: the record's
``plots`` lists them, a results folder redrawn changes nothing but ``plots``, and records
of cases that failed or were skipped are left alone."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench import redraw, registry, suite

_FAKE_CASES = '''
from pipetrain.bench.case import BenchResult, Case, Table
from pipetrain.bench.drawings import bars


def _run(context):
    (context.out / "own.png").write_bytes(b"drawn by the run")
    return BenchResult(tables=[Table(title="Fake", columns=["size", "ratio"],
                                     rows=[["32 KiB", "1.5x"], ["1 MiB", "-"]], key="only")],
                       plots=["own.png"], data={"size": (1, 2)})


def _draw(tables, data, out):
    assert data == {"size": [1, 2]}  # as the result file holds it
    return bars(out / "fake_draws_ratio.png", tables[0], "size", {"ratio": "ratio"},
                title="ratio", ylabel="x")


def _broken(tables, data, out):
    raise KeyError("no such column")


DRAWS = Case(name="fake_draws", title="Draws", run=_run, draw=_draw, quick_seconds=1,
             full_seconds=1)
BROKEN = Case(name="fake_broken", title="Draws badly", run=_run, draw=_broken,
              quick_seconds=1, full_seconds=1)
'''


@pytest.fixture
def fake_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fake cases with ``draw`` registered beside the real ones."""
    (tmp_path / "fake_drawing_cases.py").write_text(textwrap.dedent(_FAKE_CASES))
    for name, attribute in {"fake_draws": "DRAWS", "fake_broken": "BROKEN"}.items():
        (tmp_path / f"{name}.py").write_text(
            f"from fake_drawing_cases import {attribute} as CASE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "CASES", {**registry.CASES, "fake_draws": "fake_draws",
                                            "fake_broken": "fake_broken"})


def _read(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text())
    assert isinstance(record, dict)
    return record


def test_the_suite_draws_after_the_run_and_redraw_draws_again(
        fake_cases: None, tmp_path: Path) -> None:
    out = tmp_path / "results"
    lines: list[str] = []
    suite.run_suite(["fake_draws", "fake_broken"], quick=True, out=out, command="x",
                    progress=lines.append)
    drawn = _read(out / "fake_draws.json")
    assert drawn["status"] == "ok" and "draw_error" not in drawn
    assert drawn["plots"] == ["own.png", "fake_draws_ratio.png"]
    assert (out / "fake_draws_ratio.png").read_bytes()[:4] == b"\x89PNG"
    broken = _read(out / "fake_broken.json")
    assert broken["status"] == "ok" and broken["plots"] == ["own.png"]
    assert broken["draw_error"] == "KeyError: 'no such column'"
    assert "  fake_broken: drawing failed: KeyError: 'no such column'" in lines

    (out / "fake_draws_ratio.png").unlink()
    drawn["plots"] = ["own.png"]
    suite.write_json(out / "fake_draws.json", drawn)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    done = {r.name: r for r in redraw.redraw(out)}
    assert done["fake_draws"].plots == ("fake_draws_ratio.png",)
    assert done["fake_broken"].failed and "KeyError" in str(done["fake_broken"].reason)
    assert (out / "fake_draws_ratio.png").is_file()
    after = _read(out / "fake_draws.json")
    assert after == {**drawn, "plots": ["own.png", "fake_draws_ratio.png"]}
    for name in ("fake_broken.json", "summary.json"):
        assert (out / name).read_bytes() == before[name]
    assert redraw.main([str(out)]) == 1  # the broken drawing


def _record(name: str, status: str, tables: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "quick": True, "wall_s": 1.0, "cpu_s": 1.0, "tables": tables,
            "plots": [], "data": {"sizes": {"reps": 2}}, "title": name, "status": status,
            "reason": None if status == "ok" else "it broke", "metadata": {"date": "2026"}}


def test_redraw_updates_plots_only_and_leaves_cases_that_did_not_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = {"title": "Round trips", "key": "round_trip", "anchor": "raw", "notes": "",
             "columns": ["message", "raw us", "inline / raw", "inline+thread / raw",
                         "apart / raw", "apart+thread / raw"],
             "rows": [["32 KiB", 105.3, 2.87, 3.68, 4.75, 6.77],
                      ["4096 KiB", 1961.3, 2.46, 2.77, "-", 2.32]]}
    records = {"transport": _record("transport", "ok", [table]),
               "planner": _record("planner", "failed", []),
               "gpipe_table2": _record("gpipe_table2", "skipped", []),
               "planner_speed": _record("planner_speed", "ok", [])}
    for name, record in records.items():
        suite.write_json(tmp_path / f"{name}.json", record)
    (tmp_path / "summary.json").write_text('{"cases": []}\n')
    (tmp_path / "notes.json").write_text("[1, 2]\n")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}

    assert redraw.main([str(tmp_path)]) == 0
    after = _read(tmp_path / "transport.json")
    assert after == {**records["transport"], "plots": ["transport_round_trip.png"]}
    assert (tmp_path / "transport_round_trip.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("planner.json", "gpipe_table2.json", "planner_speed.json", "summary.json",
                 "notes.json"):
        assert (tmp_path / name).read_bytes() == before[name], name
    err = capsys.readouterr().err
    assert "transport: transport_round_trip.png" in err
    assert "planner: left as it is (status 'failed', not 'ok')" in err

    assert redraw.main([str(tmp_path)]) == 0  # again: the same pictures, listed once
    assert _read(tmp_path / "transport.json")["plots"] == ["transport_round_trip.png"]


def test_redraw_refuses_a_folder_that_is_not_one(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert redraw.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
