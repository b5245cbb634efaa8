"""The examples in the schedule modules' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import pipetrain.schedule

MODULES = [
    "pipetrain.schedule",
    *sorted(
        m.name for m in pkgutil.iter_modules(pipetrain.schedule.__path__, "pipetrain.schedule.")
    ),
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no examples"
