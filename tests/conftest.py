"""Test-suite set-up: make ``tests/helpers`` importable as ``helpers`` (also in spawned
workers), and give every test the process's intra-op thread count as it found it."""

import os
import sys
from collections.abc import Iterator

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """A test that runs code setting ``torch.set_num_threads`` in this process (a
    benchmark helper, an in-process job) must not change it for the tests after it."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
