"""The planner is pure Python: importing it (and running ``pipetrain plan``) needs no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pipetrain

from .test_doctests import MODULES

SOURCE = Path(pipetrain.__file__).resolve().parents[1]


def test_planner_modules_import_without_torch() -> None:
    program = (
        "import importlib, sys\n"
        f"for name in {[*MODULES, 'pipetrain.cli.plan']!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(n for n in ('torch', 'numpy', 'matplotlib') if n in sys.modules))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONPATH": str(SOURCE)},
    )
    assert completed.stdout.strip() == "[]", completed.stdout
