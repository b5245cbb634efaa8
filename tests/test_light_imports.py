"""The pure-Python layers stay cheap to import: no torch, no matplotlib.

The schedule layer (IR, generators, validator, simulator; matplotlib only inside the
PNG renderer) and the trace layer import neither, so ``pipetrain simulate`` and trace
tooling start in milliseconds and work without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipetrain

SOURCE = Path(pipetrain.__file__).resolve().parents[1]
PROGRAM = """
import importlib, pkgutil, sys
import {package} as package
for module in pkgutil.iter_modules(package.__path__, "{package}."):
    importlib.import_module(module.name)
print(sorted(name for name in ("torch", "matplotlib") if name in sys.modules))
"""


@pytest.mark.parametrize("package", ["pipetrain.schedule", "pipetrain.trace"])
def test_importing_the_layer_imports_neither_torch_nor_matplotlib(package: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(SOURCE)}
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(package=package)],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    assert completed.stdout.strip() == "[]", completed.stdout
