"""The examples in the trace modules' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import pipetrain.trace

MODULES = [
    "pipetrain.trace",
    *sorted(m.name for m in pkgutil.iter_modules(pipetrain.trace.__path__, "pipetrain.trace.")),
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no examples"
