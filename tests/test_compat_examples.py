"""The ``Example:`` sections of the compat-layer modules run as written (doctest)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "pipetrain.microbatch",
    "pipetrain.checkpoint",
    "pipetrain.batchnorm",
    "pipetrain.skip",
    "pipetrain.skip.namespace",
    "pipetrain.skip.tracker",
    "pipetrain.skip.skippable",
    "pipetrain.skip.layout",
    "pipetrain.partition",
    "pipetrain.partition.split",
    "pipetrain.partition.solve",
    "pipetrain.partition.profile",
    "pipetrain.partition.balance",
    "pipetrain.balance",
    "pipetrain.models.unet",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
