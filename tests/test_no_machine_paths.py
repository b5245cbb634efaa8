"""Committed results and docs name no path of the machine they were made on (they read
``profiles from /work/shared/pipedream``): records give paths relative to the checkout,
or the environment variable that named them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|Users|private|mnt|scratch)/[\w.-]+")
"""An absolute path under a machine's own folders (an example command's /tmp/run is not
a record of where something was)."""


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_committed_results_name_no_machine_path() -> None:
    files = sorted((ROOT / "docs" / "bench").glob("*.json"))
    assert files
    found = {f"{path.name}: {match}" for path in files
             for text in _strings(json.loads(path.read_text()))
             for match in MACHINE_PATH.findall(text) + re.findall(r"^/tmp/\S+", text)}
    assert not found, sorted(found)


def test_docs_name_no_machine_path() -> None:
    documents = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {f"{path.name}: {match}" for path in documents
             for match in MACHINE_PATH.findall(path.read_text())}
    assert not found, sorted(found)
    assert MACHINE_PATH.findall("profiles from /work/shared/pipedream") == ["/work/shared"]
