"""The pure-Python layers stay cheap to import: no torch, no matplotlib.

The schedule layer (IR, generators, validator, simulator; matplotlib only inside the
PNG renderer) and the trace layer import neither, so ``pipetrain simulate`` and trace
tooling start in milliseconds and work without torch. The launcher of ``pipetrain train``
imports torch, but not what only its workers use.
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


_LAUNCHER_PROBE = """
import sys
import pipetrain.launch

def probe(*args, **kwargs):
    heavy = ("torch.distributed.tensor", "sympy", "torch._dynamo", "matplotlib", "transformers")
    print(",".join(m for m in heavy if m in sys.modules))
    raise SystemExit(0)

pipetrain.launch.launch_local = probe
from pipetrain.cli.main import main
main(["train", "--steps", "1", "--out", sys.argv[1]])
"""


def test_the_launcher_starts_the_workers_without_importing_what_only_they_use(tmp_path: Path) -> None:
    """Every run waits for the launcher before a worker starts: it imported DTensor (and
    with it sympy) through the configuration's gradient checks, about a second and a half
    of start-up that only workers need."""
    done = subprocess.run([sys.executable, "-c", _LAUNCHER_PROBE, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"the launcher imported {done.stdout.strip()}"
