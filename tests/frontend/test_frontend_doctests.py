"""The examples in the frontend modules' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "pipetrain.frontend",
    "pipetrain.frontend.capture",
    "pipetrain.frontend.cuts",
    "pipetrain.frontend.errors",
    "pipetrain.frontend.hf",
    "pipetrain.frontend.inputs",
    "pipetrain.frontend.materialize",
    "pipetrain.frontend.modes",
    "pipetrain.frontend.names",
    "pipetrain.frontend.pipelines",
    "pipetrain.frontend.planning",
    "pipetrain.frontend.recapture",
    "pipetrain.frontend.sizes",
    "pipetrain.frontend.source",
    "pipetrain.frontend.unit_module",
    "pipetrain.frontend.units",
    "pipetrain.cli.hf_models",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
