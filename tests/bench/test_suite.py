"""``pipetrain bench``: the registry, the suite runner (fake cases that pass, fail and skip),
the docs generator on a copy of docs/benchmarks.md, the command's refusals, and (slow) the
whole suite at ``--quick`` size."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench import docs, registry, suite
from pipetrain.bench.case import Case
from pipetrain.cli.main import main
from pipetrain.schedule import TRAINING_SCHEDULES

ROOT = Path(__file__).resolve().parents[2]

_FAKE_CASES = '''
from pipetrain.bench.case import BenchResult, Case, Goal, SkipCase, Table


def _ok(context):
    context.progress("half way")
    return BenchResult(tables=[Table(title="Fake", columns=["a", "b"], rows=[[1, 2.5]],
                                     anchor="nothing", key="only")],
                       data={"quick": context.quick})


def _boom(context):
    raise RuntimeError("the fake case broke")


def _no_data(context):
    raise SkipCase("no data here")


OK = Case(name="fake_ok", title="Passes", run=_ok, quick_seconds=1, full_seconds=1)
BOOM = Case(name="fake_boom", title="Fails", run=_boom, quick_seconds=1, full_seconds=1)
NO_DATA = Case(name="fake_no_data", title="No data", run=_no_data, quick_seconds=1,
               full_seconds=1)
NO_PACKAGE = Case(name="fake_no_package", title="Needs a package", run=_ok, quick_seconds=1,
                  full_seconds=1, needs=("no_such_package_for_pipetrain",))


def _short(context):
    goals = [Goal.at_least("plan / even split", 0.53, 1.3, unit="x"),
             Goal.at_most("step vs ideal", 0.02, 0.05, unit="%")]
    return BenchResult(tables=[Table(title="Short", columns=["ratio"], rows=[["0.53x"]],
                                     goals=goals)],
                       warnings=["plan: repetitions disagree"])


SHORT = Case(name="fake_short", title="Misses a goal", run=_short, quick_seconds=1,
             full_seconds=1)
'''


@pytest.fixture
def fake_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Four fake cases registered in place of the real ones (one module per case)."""
    names = {"fake_ok": "OK", "fake_boom": "BOOM", "fake_no_data": "NO_DATA",
             "fake_no_package": "NO_PACKAGE", "fake_short": "SHORT"}
    (tmp_path / "fake_bench_cases.py").write_text(textwrap.dedent(_FAKE_CASES))
    for name, attribute in names.items():
        (tmp_path / f"{name}.py").write_text(
            f"from fake_bench_cases import {attribute} as CASE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {name: name for name in names}
    cases["fake_missing_module"] = "pipetrain.bench.cases.no_such_case_module"
    monkeypatch.setattr(registry, "CASES", cases)
    return list(cases)


def test_registry_lists_every_case_module_with_its_case() -> None:
    assert registry.case_names() == list(registry.CASES)
    for name in registry.case_names():
        case = registry.load_case(name)
        assert isinstance(case, Case) and case.name == name
        assert 0 < case.quick_seconds <= case.full_seconds
    entries = registry.available()
    assert [e.name for e in entries] == registry.case_names()


def test_registry_refuses_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cases 'nope', 'nada'; the cases are: ") as error:
        registry.check_names(["transport", "nope", "nada"])
    assert all(name in str(error.value) for name in registry.case_names())
    assert registry.check_names(["transport", "planner"]) == ["transport", "planner"]


def test_a_missing_package_skips_with_its_reason(fake_cases: list[str]) -> None:
    entries = {e.name: e for e in registry.available()}
    assert entries["fake_ok"].skip_reason is None
    assert entries["fake_no_package"].skip_reason == (
        "needs no_such_package_for_pipetrain, which is not installed "
        "(pip install no_such_package_for_pipetrain)")
    assert entries["fake_missing_module"].skip_reason is not None
    assert "cannot be imported" in entries["fake_missing_module"].skip_reason
    missing = ModuleNotFoundError("No module named 'torchgpipe'", name="torchgpipe")
    assert registry.import_failure(missing) == (
        "needs torchgpipe, which is not installed (pip install 'pipetrain[bench]')")


def test_the_suite_records_every_case_and_goes_on_after_a_failure(
        fake_cases: list[str], tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "results"
    summary = suite.run_suite(fake_cases, quick=True, out=out, command="pipetrain bench x",
                              progress=lines.append)
    statuses = {c["name"]: c["status"] for c in summary["cases"]}
    assert statuses == {"fake_ok": "ok", "fake_boom": "failed", "fake_no_data": "skipped",
                        "fake_no_package": "skipped", "fake_short": "ok",
                        "fake_missing_module": "failed"}
    assert json.loads((out / "summary.json").read_text())["cases"] == summary["cases"]

    ok = json.loads((out / "fake_ok.json").read_text())
    assert ok["tables"] == [{"title": "Fake", "columns": ["a", "b"], "rows": [[1, 2.5]],
                             "anchor": "nothing", "notes": "", "key": "only"}]
    assert ok["data"] == {"quick": True} and ok["quick"] is True and ok["wall_s"] >= 0
    assert ok["cpu_s"] >= 0
    meta = ok["metadata"]
    assert meta["command"] == "pipetrain bench x" and meta["date"][:2] == "20"
    assert {"cpu_model", "cores", "memory_bytes", "load_average_before",
            "load_average_after"} <= set(meta["machine"])
    assert {"python", "torch", "pipetrain", "torchgpipe", "transformers"} <= set(meta["versions"])
    assert meta["versions"]["torch"] is not None

    boom = json.loads((out / "fake_boom.json").read_text())
    assert boom["reason"] == "RuntimeError: the fake case broke"
    assert "Traceback" in boom["error"] and boom["tables"] == []
    assert json.loads((out / "fake_no_data.json").read_text())["reason"] == "no data here"
    assert "no_such_package_for_pipetrain" in json.loads(
        (out / "fake_no_package.json").read_text())["reason"]

    assert lines[0] == "[1/6] fake_ok: started"
    assert "  fake_ok: half way" in lines
    assert any(line.startswith("[2/6] fake_boom: failed in ") for line in lines)
    ends = [line for line in lines if ": warning: " not in line]  # a busy machine adds some
    assert ends[-1].startswith("[6/6] fake_missing_module: failed in ")
    assert "cannot be imported" in ends[-1]
    # every record of the run names the same run
    runs = {json.loads((out / f"{n}.json").read_text())["metadata"]["run_id"] for n in statuses}
    assert runs == {summary["run_id"]}


def test_a_case_that_misses_a_goal_is_ok_and_says_which(
        fake_cases: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    summary = suite.run_suite(["fake_ok", "fake_short"], quick=True, out=tmp_path,
                              command="pipetrain bench", progress=lines.append)
    short = json.loads((tmp_path / "fake_short.json").read_text())
    assert short["status"] == "ok"
    assert short["reason"] == "goals missed: plan / even split 0.53x (goal >= 1.30x)"
    assert [g["met"] for g in short["goals"]] == [False, True]
    assert "plan: repetitions disagree" in short["warnings"]
    assert "Goals: plan / even split 0.53x (goal >= 1.30x): MISSED; step vs ideal 2.0% " \
        "(goal <= 5.0%): met." in docs.block_text(short)
    entry = summary["cases"][1]
    assert entry["goals_missed"] == ["plan / even split"] and entry["reason"] == short["reason"]
    assert summary["cases"][0]["goals_missed"] == [] and summary["cases"][0]["reason"] is None
    assert any(line.startswith("[2/2] fake_short: ok in ") and "goals missed: plan" in line
               for line in lines)
    assert "[2/2] fake_short: warning: plan: repetitions disagree" in lines
    # the command's summary line lists the missed goals too
    assert main(["bench", "fake_short", "--quick", "--out", str(tmp_path / "c")]) == 0
    assert "goals missed: plan / even split" in capsys.readouterr().out


_RECORD: dict[str, Any] = {
    "name": "transport", "status": "ok", "reason": None, "quick": False, "wall_s": 61.0,
    "tables": [{"title": "Round trips", "columns": ["message", "ratio"], "rows": [["32 KiB", 1.5]],
                "anchor": "raw isend/irecv", "notes": "", "key": "round_trip"},
               {"title": "Second", "columns": ["x"], "rows": [[7]], "anchor": "", "notes": "",
                "key": "second"}],
    "plots": [], "data": {},
    "metadata": {"date": "2026-11-28T10:00:00+00:00", "command": "pipetrain bench transport",
                 "machine": {"cpu_model": "AMD EPYC", "cores": 2, "memory_bytes": 24 * 2**30,
                             "load_average_before": [0.1, 0.1, 0.1],
                             "load_average_after": [1.2, 0.4, 0.2]},
                 "versions": {"python": "3.11.7", "torch": "2.13.0", "pipetrain": "0.1.0",
                              "torchgpipe": "0.0.7", "transformers": None}},
}


def test_the_docs_generator_fills_the_marked_blocks_of_a_copy_of_the_doc(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "transport.json").write_text(json.dumps(_RECORD))
    (results / "summary.json").write_text("{}")
    doc = tmp_path / "benchmarks.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "<!-- bench:transport:begin -->" in original  # the real doc marks the case
    doc.write_text(original)
    assert docs.main([str(results), "--into", str(doc)]) == 0
    text = doc.read_text()
    block = text.split("<!-- bench:transport:begin -->")[1].split("<!-- bench:transport:end -->")[0]
    assert "**Round trips**" in block and "| 32 KiB | 1.5 |" in block and "| 7 |" in block
    assert ("*Generated from `pipetrain bench transport`, run 2026-11-28T10:00:00+00:00 (61 s): "
            "AMD EPYC, 2 cores, 24 GiB, load average 0.1 before and 1.2 after; Python 3.11.7, "
            "torch 2.13.0, pipetrain 0.1.0, torchgpipe 0.0.7.*") in block
    pictures = text.split("<!-- bench:transport/plots:begin -->")[1].split(
        "<!-- bench:transport/plots:end -->")[0]
    assert "drew no picture" in pictures  # the record lists none
    def emptied(doc_text: str) -> str:  # the transport blocks' contents taken out
        for target in ("transport", "transport/plots"):
            begin, end = f"<!-- bench:{target}:begin -->", f"<!-- bench:{target}:end -->"
            head, rest = doc_text.split(begin)
            doc_text = head + begin + end + rest.split(end, 1)[1]
        return doc_text

    assert emptied(text) == emptied(original)  # nothing else changed
    again, done = docs.regenerate(text, {"transport": _RECORD}, pictures="results")
    assert again == text and done == ["transport", "transport/plots"]  # idempotent


def test_the_docs_generator_takes_one_table_by_key_and_reports_mistakes() -> None:
    text = "a\n<!-- bench:transport/second:begin -->\nold\n<!-- bench:transport/second:end -->\nb\n"
    new, done = docs.regenerate(text, {"transport": _RECORD})
    assert done == ["transport/second"] and "| 7 |" in new and "Round trips" not in new
    assert new.startswith("a\n") and new.endswith("\nb\n")
    unchanged, none = docs.regenerate(text, {})
    assert unchanged == text and none == []
    with pytest.raises(ValueError, match="no table with key 'third'; its keys: round_trip, second"):
        docs.regenerate(text.replace("second", "third"), {"transport": _RECORD})
    with pytest.raises(ValueError, match="has no end marker"):
        docs.regenerate("<!-- bench:transport:begin -->\n", {"transport": _RECORD})
    failed = {**_RECORD, "status": "failed", "reason": "RuntimeError: boom"}
    assert docs.block_text(failed) == ("*Not measured: `pipetrain bench transport` "
                                       "(2026-11-28T10:00:00+00:00) failed this case: "
                                       "RuntimeError: boom.*")


def test_the_docs_generator_refuses_a_folder_without_results(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("x\n")
    assert docs.main([str(tmp_path), "--into", str(doc)]) == 2
    assert "holds no result of pipetrain bench" in capsys.readouterr().err
    assert doc.read_text() == "x\n"


def test_the_command_refuses_unknown_and_repeated_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrain bench: error: unknown case 'nope'; the cases are: ")
    assert all(name in err for name in registry.case_names())
    assert main(["bench", "transport", "transport", "--out", str(tmp_path / "b")]) == 2
    assert "case transport named twice" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["bench", "planner_speed", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_command_lists_the_cases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == registry.case_names()


def test_the_command_runs_a_case_and_writes_its_result(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    assert main(["bench", "planner_speed", "--quick", "--out", str(out)]) == 0
    record = json.loads((out / "planner_speed.json").read_text())
    assert record["status"] == "ok" and record["quick"] is True
    assert len(record["tables"][0]["rows"]) == 9
    assert record["metadata"]["command"].startswith("pipetrain bench planner_speed --quick")
    captured = capsys.readouterr()
    assert "[1/1] planner_speed: ok in" in captured.err
    assert captured.out.splitlines()[0].split()[:2] == ["planner_speed", "ok"]


_MODULES = ["registry", "run_info", "docs", "case", "suite", "harness.output", "harness.stats",
            "vs_torch.options", "vs_torch.tables", "vs_torch.costs", "vs_torch.runners", "vs_torch.plain",
            "gpipe_runs", "cases.planner_speed", "cases.async_convergence",
            "cases.planner_vs_pipedream", "plots"]


@pytest.mark.parametrize("name", _MODULES)
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipetrain.bench.{name}")
    result = doctest.testmod(module)
    assert result.failed == 0
    assert result.attempted > 0


def _skipped_for_a_missing_input(name: str, record: dict[str, Any]) -> bool:
    case = registry.load_case(name)
    missing = [p for p in case.needs if importlib.util.find_spec(p) is None]
    # PipeDream's published profiles are in ../shared/pipedream beside every checkout:
    # planner_vs_pipedream runs
    return record["status"] == "skipped" and bool(missing) and all(
        p in record["reason"] for p in missing)


_RUN_BY_THEIR_OWN_TESTS = {
    "torchgpipe_paper": "tests/bench/test_torchgpipe_paper.py",  # measure() on a tiny plan
    "pipedream_claims": "tests/bench/test_pipedream_claims.py",  # the quick case, fake graphs
    # a real trial under the watchdog, the quick searches' jobs, tables from given searches
    "gpipe_table1": "tests/bench/test_gpipe_table1.py",
}
"""Cases whose own tests run them for real: the whole-suite run leaves them out."""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_whole_suite_runs_at_quick_size(tmp_path: Path) -> None:
    """``pipetrain bench --quick`` with every case but those run by their own tests."""
    out = tmp_path / "quick"
    names = [n for n in registry.case_names() if n not in _RUN_BY_THEIR_OWN_TESTS]
    assert len(names) == len(registry.case_names()) - len(_RUN_BY_THEIR_OWN_TESTS)
    done = subprocess.run([sys.executable, "-m", "pipetrain", "bench", "--quick", *names,
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=850)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [c["name"] for c in summary["cases"]] == names
    for name in names:
        record = json.loads((out / f"{name}.json").read_text())
        assert record["name"] == name and record["quick"] is True
        if record["status"] != "ok":
            assert _skipped_for_a_missing_input(name, record), record
            continue
        assert record["tables"], name
        assert any(table["rows"] for table in record["tables"]), name
        for table in record["tables"]:
            # a table left empty at the quick size says so in its notes
            assert table["rows"] or "skipped" in (table["notes"] or ""), (name, table["title"])
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), \
                (name, table["title"])
        meta = record["metadata"]
        assert meta["command"] == f"pipetrain bench --quick {' '.join(names)} --out {out}"
        assert meta["machine"]["cores"] and meta["machine"]["load_average_after"] is not None
        assert meta["versions"]["pipetrain"] and meta["versions"]["torch"]
        assert f"[{names.index(name) + 1}/{len(names)}] {name}" in done.stderr
    # the schedules case at quick size: every schedule simulated, each measured at K = 2,
    # and its picture drawn
    (table,) = json.loads((out / "schedules.json").read_text())["tables"]
    assert {row[2] for row in table["rows"]} == set(TRAINING_SCHEDULES)
    measured = [row for row in table["rows"] if row[1] == 2]
    assert len(measured) == len(TRAINING_SCHEDULES) and all(row[3] and row[3] > 0 for row in measured)
    assert (out / "schedules_mlp.png").stat().st_size > 0
