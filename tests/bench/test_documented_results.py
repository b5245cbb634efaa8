"""The tables and pictures of docs/benchmarks.md are the committed results of a full
``pipetrain bench`` run (docs/bench/), as ``python -m pipetrain.bench.docs`` writes them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pipetrain.bench import docs, registry

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "bench"


def _marked() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if docs.markers(p.read_text())]


def test_the_documented_tables_are_what_the_generator_makes_of_the_committed_results() -> None:
    results = docs.load_results(RESULTS)
    assert DOC in _marked()
    for path in _marked():
        text = path.read_text()
        pictures = os.path.relpath(RESULTS, path.parent)
        regenerated, done = docs.regenerate(text, results, pictures=pictures)
        assert regenerated == text, f"{path.name} differs from its results: run python -m " \
            f"pipetrain.bench.docs docs/bench --into {path.relative_to(ROOT)}"
        assert sorted(done) == sorted(docs.markers(text))  # every block came from a result


def test_the_committed_results_are_one_full_run_of_every_case() -> None:
    results = docs.load_results(RESULTS)
    assert sorted(results) == sorted(registry.case_names())
    fix = "run every case at once: pipetrain bench --out DIR, then copy DIR into docs/bench"
    runs = {record["metadata"].get("run_id") for record in results.values()}
    assert len(runs) == 1 and None not in runs, f"the results come from {len(runs)} runs; {fix}"
    for name, record in results.items():
        assert record["quick"] is False, name
        command = record["metadata"]["command"].split()
        # the whole suite: no case named on the command line
        assert command[:2] == ["pipetrain", "bench"] and command[2:3] == ["--out"], (name, fix)
    text = DOC.read_text()
    for name in results:
        assert f"<!-- bench:{name}" in text, f"docs/benchmarks.md shows nothing of {name}"


def test_every_picture_the_documents_show_is_committed() -> None:
    assert re.search(r"!\[[^\]]*\]\(bench/", DOC.read_text())
    for path in _marked():
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()):
            assert (path.parent / link).is_file(), (path.name, link)
