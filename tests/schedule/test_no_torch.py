"""The schedule layer is pure Python: importing it loads neither torch nor matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pipetrain

SOURCE = Path(pipetrain.__file__).resolve().parents[1]
PROGRAM = """
import importlib, pkgutil, sys
import pipetrain.schedule as schedule
for module in pkgutil.iter_modules(schedule.__path__, "pipetrain.schedule."):
    importlib.import_module(module.name)
import pipetrain.cli.simulate
print(sorted(name for name in ("torch", "matplotlib") if name in sys.modules))
"""


def test_importing_the_schedule_layer_does_not_import_torch() -> None:
    env = {**os.environ, "PYTHONPATH": str(SOURCE)}
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert completed.stdout.strip() == "[]"
