"""Test-suite set-up: make ``tests/helpers`` importable as ``helpers`` (also in spawned
workers), compile pipetrain's and the tests' modules to bytecode once, and give every test
the process's intra-op thread count as it found it."""

import compileall
import os
import sys
from collections.abc import Iterator

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config: pytest.Config) -> None:
    """Write the bytecode of ``src/`` and ``tests/`` before any test runs: the suite starts
    hundreds of worker processes, each importing pipetrain, and an editable install has
    none (pip compiles only what it copies), nor is any written where
    ``PYTHONDONTWRITEBYTECODE`` is set; each process then compiled every module it
    imports again. Up to date files are skipped."""
    for folder in (os.path.join(os.path.dirname(_HERE), "src"), _HERE):
        compileall.compile_dir(folder, quiet=2)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """A test that runs code setting ``torch.set_num_threads`` in this process (a
    benchmark helper, an in-process job) must not change it for the tests after it."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
