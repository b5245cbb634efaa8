"""A pytest plugin for the GPU check: keeps only the tests that need CUDA, and writes
each one's outcome as JSON.

A test needs CUDA when one of its ``skipif`` marks names CUDA or a GPU in its reason
(``needs CUDA``, ``needs a GPU``, ``needs two CUDA devices``...), whatever the mark's
condition is here. Load it with ``-p gpu.cuda_tests_plugin --gpu-check-report=PATH``.

The tests need pytest alone: where pytest-timeout is not installed, the plugin declares
its ``timeout`` marker (the suite's ``--strict-markers`` would otherwise refuse to collect
a file that uses it), and the tests run without a per-test limit.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

__all__ = ["needs_cuda", "pytest_addoption", "pytest_collection_modifyitems",
           "pytest_collectreport", "pytest_configure", "pytest_runtest_logreport",
           "pytest_sessionfinish"]

NEEDS_CUDA = re.compile(r"\b(cuda|gpus?)\b", re.IGNORECASE)


def needs_cuda(item: pytest.Item) -> str | None:
    """The reason of the first ``skipif`` mark of ``item`` that names CUDA or a GPU."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if NEEDS_CUDA.search(reason):
            return reason
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-check-report", default=None,
                     help="write the CUDA tests' outcomes to this JSON file")


_OUTCOMES: dict[str, dict[str, Any]] = {}
_COLLECT_ERRORS: list[dict[str, str]] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _COLLECT_ERRORS.append({"file": report.nodeid, "message": str(report.longreprtext)[-2000:]})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        reason = needs_cuda(item)
        if reason is None:
            drop.append(item)
        else:
            keep.append(item)
            _OUTCOMES[item.nodeid] = {"test": item.nodeid, "needs": reason,
                                      "outcome": "not run", "seconds": 0.0}
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


_REPORT: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout absent or disabled
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's per-test limit "
                                           "(not installed here: no limit)")
    path = config.getoption("--gpu-check-report", None)
    if path:
        _REPORT.append(path)


def _write(exitstatus: int | None) -> None:
    """The report so far (written after every test: a run that is ended keeps it)."""
    if _REPORT:
        with open(_REPORT[0] + ".partial", "w") as f:
            json.dump({"exitstatus": exitstatus, "tests": list(_OUTCOMES.values()),
                       "collect_errors": _COLLECT_ERRORS}, f)
        os.replace(_REPORT[0] + ".partial", _REPORT[0])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _OUTCOMES.setdefault(report.nodeid, {"test": report.nodeid, "needs": None,
                                                  "outcome": "not run", "seconds": 0.0})
    record["seconds"] = round(record["seconds"] + report.duration, 3)
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        record.update(outcome="skipped", message=str(reason).removeprefix("Skipped: "))
    elif report.failed:
        record.update(outcome="error" if report.when != "call" else "failed",
                      message=str(report.longreprtext)[-2000:])
    elif report.when == "call" and record["outcome"] == "not run":
        record["outcome"] = "passed"
    if report.when == "teardown":
        _write(None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(int(exitstatus))
