"""Item ``cuda_tests``: every test of ``tests/`` that needs CUDA, run with pytest.

The tests are the ones whose ``skipif`` reason names CUDA or a GPU
(:mod:`gpu.cuda_tests_plugin`), looked for in the test files that mention ``cuda``. On
the CPU they are collected and skip, and the item records each one's reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from gpu.common import ItemContext, run_command

__all__ = ["cuda_test_files", "run", "summarize"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PER_TEST_TIMEOUT_S = 120


def cuda_test_files(tests_dir: str) -> list[str]:
    """The test files (``test_*.py``) under ``tests_dir`` that mention ``cuda``."""
    found = []
    for folder, _, names in os.walk(tests_dir):
        for name in sorted(names):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, errors="replace") as f:
                    if "cuda" in f.read().lower():
                        found.append(os.path.relpath(path, _ROOT))
    return sorted(found)


def summarize(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts by outcome, and the skip reasons with their counts.

    Example:
        >>> summarize([{"outcome": "skipped", "message": "needs CUDA"},
        ...            {"outcome": "passed"}])["counts"]
        {'passed': 1, 'skipped': 1}
    """
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
        if test["outcome"] == "skipped":
            reasons[test.get("message", "")] = reasons.get(test.get("message", ""), 0) + 1
    return {"counts": dict(sorted(counts.items())), "skip_reasons": reasons}


def run(ctx: ItemContext) -> dict[str, Any]:
    files = cuda_test_files(os.path.join(_ROOT, "tests"))
    report = os.path.join(ctx.out_dir, "cuda_tests.pytest.json")
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               "-p", "gpu.cuda_tests_plugin", f"--gpu-check-report={report}",
               f"--junitxml={os.path.join(ctx.out_dir, 'cuda_tests.junit.xml')}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    limit = max(10.0, ctx.left() - 5)
    code, output = run_command(command, timeout=limit, cwd=_ROOT)
    try:
        with open(report) as f:
            outcome = json.load(f)
    except (OSError, ValueError):
        return {"status": "failed", "files": files, "exit_code": code,
                "reason": f"pytest wrote no report (exit code {code})",
                "output_tail": output[-3000:]}
    tests = outcome["tests"]
    errors = outcome.get("collect_errors", [])
    result: dict[str, Any] = {"files": files, "exit_code": code, **summarize(tests),
                              "collect_errors": errors, "tests": tests,
                              "output_tail": output[-1500:]}
    if code is None:
        done = sum(t["outcome"] != "not run" for t in tests)
        result.update(status="failed", reason=f"pytest did not finish within {limit:.0f} s "
                      f"({done} of {len(tests)} tests done; the rest are 'not run')")
        return result
    bad = [t["test"] for t in tests if t["outcome"] in ("failed", "error", "not run")]
    bad += [f"{e['file']} (could not be collected)" for e in errors]
    ran = [t for t in tests if t["outcome"] == "passed"]
    if not tests:
        result.update(status="failed", reason="no test that needs CUDA was found")
    elif bad:
        result.update(status="failed",
                      reason=f"{len(bad)} of {len(tests) + len(errors)} failed: " + ", ".join(bad)[:800])
    elif code not in (0, 5):
        result.update(status="failed", reason=f"pytest exited with {code}")
    elif not ran:
        reasons = "; ".join(f"{n} x {r!r}" for r, n in result["skip_reasons"].items())
        result.update(status="skipped", reason=f"all {len(tests)} skipped on {ctx.device}: {reasons}")
    else:
        skipped = len(tests) - len(ran)
        result.update(status="ok", reason=None if not skipped else
                      f"{len(ran)} passed, {skipped} skipped (see skip_reasons)")
    return result
