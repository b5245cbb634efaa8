"""The one-call GPU check (``benchmarks/gpu``): its pieces, and the whole check run on
the CPU with ``--device cpu --quick``, so that it keeps working while no GPU runs it."""

from __future__ import annotations

import argparse
import doctest
import importlib
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCHMARKS = os.path.join(_ROOT, "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from gpu import check  # noqa: E402
from gpu.items import ITEMS, Item, by_name  # noqa: E402
from gpu.max_model import largest  # noqa: E402
from gpu.streams import gpu_events, overlap_report  # noqa: E402


@pytest.mark.parametrize("name", ["common", "items", "streams", "max_model", "cuda_tests",
                                  "vs_torchgpipe"])
def test_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(f"gpu.{name}"))
    assert result.attempted > 0 and result.failed == 0


def test_search_doubles_then_bisects_and_stops_when_out_of_time() -> None:
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= 37

    found = largest(fits, limit=1000)
    assert (found["largest"], found["first_too_large"], found["complete"]) == (37, 38, True)
    assert asked[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling, then bisection in (32, 64)
    assert all(32 < n < 64 for n in asked[7:]) and len(asked) == 7 + 5
    assert largest(lambda n: n <= 0, limit=8)["largest"] == 0  # nothing fits
    capped = largest(lambda n: True, limit=20)
    assert capped["largest"] == 20 and capped["reached_limit"] and capped["first_too_large"] is None
    calls = iter(range(100))
    stopped = largest(lambda n: True, limit=10**6, out_of_time=lambda: next(calls) >= 3)
    assert stopped["largest"] == 4 and not stopped["complete"]


def test_overlap_of_streams_from_a_profiler_trace() -> None:
    trace = {"traceEvents": [
        # two compute streams, overlapping 2 us; a copy beside compute of stream 1 for 3 us
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 10, "args": {"stream": 1}},
        {"cat": "kernel", "name": "b", "ts": 8, "dur": 4, "args": {"stream": 2}},
        {"cat": "gpu_memcpy", "name": "HtoD", "ts": 15, "dur": 5, "args": {"stream": 3}},
        {"cat": "kernel", "name": "c", "ts": 17, "dur": 10, "args": {"stream": 1}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
        {"ph": "M", "name": "process_name"},
    ]}
    events = gpu_events(trace)
    assert [e["kind"] for e in events] == ["kernel", "kernel", "memcpy", "kernel"]
    report = overlap_report(events)
    assert report["concurrent_us"] == 2.0 + 3.0
    assert report["copy_beside_compute_us"] == 3.0
    assert report["gpu_busy_us"] == 12.0 + 12.0 and report["span_us"] == 27.0
    assert report["streams"]["1"] == {"busy_us": 20.0, "kernels": 2, "copies": 0}
    serial = overlap_report([{"kind": "kernel", "stream": 1, "start": 0, "end": 5},
                             {"kind": "kernel", "stream": 2, "start": 5, "end": 9}])
    assert serial["concurrent_us"] == 0.0  # touching is not overlapping


def test_an_item_that_fails_or_overstays_is_recorded(tmp_path: Any) -> None:
    args = argparse.Namespace(out_dir=str(tmp_path), device="cpu", quick=True, budget=None)
    broken = Item(name="broken", module="json", title="no run()", cuda_s=1, cpu_s=1)
    assert check.run_item(broken, args) == 0
    record = _load(str(tmp_path), "broken")
    assert record["status"] == "failed" and "has no attribute 'run'" in record["reason"]
    (tmp_path / "logs").mkdir()
    late = check.spawn_item(by_name("max_model_size"), args, timeout=1.0)
    assert late["status"] == "failed" and "did not finish within 1 s" in late["reason"]
    assert _load(str(tmp_path), "max_model_size")["status"] == "failed"


def _load(folder: str, name: str) -> dict[str, Any]:
    with open(os.path.join(folder, f"{name}.json")) as f:
        record: dict[str, Any] = json.load(f)
    return record


def test_the_cuda_tests_are_collected_without_pytest_timeout(tmp_path: Any) -> None:
    """Bug: where pytest-timeout was not installed (the docs ask for pytest alone), the
    suite's --strict-markers refused test_gpipe_errors.py ('timeout' not found in
    `markers`), and the item failed."""
    from gpu.cuda_tests import cuda_test_files

    report = tmp_path / "report.json"
    files = cuda_test_files(os.path.join(_ROOT, "tests"))
    assert "tests/api/test_gpipe_errors.py" in files  # it uses @pytest.mark.timeout
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:timeout", "-p", "gpu.cuda_tests_plugin", f"--gpu-check-report={report}"],
        cwd=_ROOT, text=True, capture_output=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([_BENCHMARKS, *sys.path])})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "not found in `markers`" not in done.stdout + done.stderr
    assert json.loads(report.read_text())["collect_errors"] == []
    assert "test_gpipe_cuda.py::" in done.stdout


@pytest.mark.slow
def test_the_check_runs_on_the_cpu(tmp_path: Any) -> None:
    out = str(tmp_path / "check")
    done = subprocess.run(["bash", os.path.join(_ROOT, "benchmarks", "gpu", "run.sh"), out,
                           "--device", "cpu", "--quick"], cwd=_ROOT, text=True,
                          capture_output=True, timeout=400,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _load(out, "summary")
    assert summary["device"] == "cpu" and summary["total_seconds"] < 400
    assert [r["item"] for r in summary["items"]] == [item.name for item in ITEMS]
    for row in summary["items"]:
        record = _load(out, row["item"])
        assert record["status"] == row["status"] in ("ok", "skipped"), record
        assert row["status"] == "ok" or row["reason"]

    tests = _load(out, "cuda_tests")
    assert tests["status"] == "skipped" and len(tests["tests"]) >= 10
    assert {t["outcome"] for t in tests["tests"]} == {"skipped"}
    assert all("cuda" in t["message"].lower() or "gpu" in t["message"].lower()
               for t in tests["tests"])
    assert any(t["test"].startswith("tests/api/test_gpipe_cuda.py::") for t in tests["tests"])

    versus = _load(out, "gpipe_vs_torchgpipe")
    assert versus["torchgpipe"]["version"] == "0.0.7"
    assert len(versus["cases"]) == 12  # 2 models x 2 precisions x 3 checkpoint modes
    ran = [c for c in versus["cases"] if c["status"] == "ok"]
    assert len(ran) >= 6 and all(c["status"] == "ok" or "time budget" in c["reason"]
                                 for c in versus["cases"])
    for case in ran:
        assert case["outputs_relative_difference"] <= case["tolerance"]
        assert 0 < case["throughput_pipetrain_over_torchgpipe"] < math.inf
        assert case["peak_mib"] is None  # not measured on the CPU

    assert "not applicable" in _load(out, "gpipe_streams")["reason"]

    pipeline = _load(out, "pipeline_one_process")
    assert pipeline["several_stages_in_one_process"] is True
    assert {(c["schedule"], c["stages_per_rank"]) for c in pipeline["cases"]} >= {
        ("interleaved-1f1b", 2), ("zb-v", 2)}
    ran = [c for c in pipeline["cases"] if c["status"] == "ok"]  # a loaded machine spends
    assert all(c["status"] == "ok" or "time budget" in c["reason"]  # the budget sooner
               for c in pipeline["cases"])
    assert {(c["schedule"], c["precision"]) for c in ran} >= {("interleaved-1f1b", "fp32"),
                                                              ("zb-v", "fp32")}
    for case in ran:
        assert case["passed"] is True, case
        assert len(case["losses"]) == pipeline["sizes"]["steps"]
        assert case["max_rel_loss_difference"] <= case["tolerance"]["loss_rel"]
        assert case["max_rel_update_difference"] <= case["tolerance"]["update_rel"]
        if case["precision"] == "fp16":
            assert case["scales_equal"] is True
        if case["precision"] != "fp32":  # autocast moved the losses: the match means something
            assert case["precision_effect_rel_update"] > 10 * case["tolerance"]["update_rel"]

    table = _load(out, "max_model_size")
    row = table["table1_row"]
    assert 1 <= row["without_rematerialization_depth"] <= row["with_rematerialization_depth"]
    assert row["parameter_ratio"] >= 1
    for name in ("without_rematerialization", "with_rematerialization"):
        search = table[name]
        assert search["complete"] and search["trials"][0]["depth"] == 1
        for trial in search["trials"]:
            assert trial["fits"] == (trial["peak_mib"] <= table["sizes"]["cap_mib"])
        fitting = [t["depth"] for t in search["trials"] if t["fits"]]
        assert max(fitting) == search["largest_depth"]
        assert search["first_depth_too_large"] == search["largest_depth"] + 1

    planner = _load(out, "planner")
    assert sum(planner["plan"]["balance"]) == 2 + 2 and len(planner["plan"]["balance"]) == 2
    assert planner["plan"]["predicted_step_s"] > 0
    assert planner["measured_step_s"]["plan_2_stages_one_process"]["median_s"] > 0

    assert "two GPUs" in _load(out, "nccl")["reason"]
