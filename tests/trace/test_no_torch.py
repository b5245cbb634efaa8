"""The trace layer is cheap to import: neither torch nor matplotlib comes with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pipetrain

SOURCE = Path(pipetrain.__file__).resolve().parents[1]
PROGRAM = """
import importlib, pkgutil, sys
import pipetrain.trace as trace
for module in pkgutil.iter_modules(trace.__path__, "pipetrain.trace."):
    importlib.import_module(module.name)
print(sorted(name for name in ("torch", "matplotlib") if name in sys.modules))
"""


def test_importing_the_trace_layer_imports_neither_torch_nor_matplotlib() -> None:
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
