"""The cost models ``pipetrain plan --cost-model NAME`` can use, by name.

Example:
    >>> get_cost_model("pipedream").name
    'pipedream'
    >>> get_cost_model("fast")
    Traceback (most recent call last):
    ...
    ValueError: unknown cost model 'fast'; known: pipedream, pipetrain (e.g. --cost-model pipetrain)
"""

from __future__ import annotations

import importlib
from typing import cast

from pipetrain.plan.costs import CostModel

__all__ = ["COST_MODEL_NAMES", "DEFAULT_COST_MODEL", "get_cost_model"]

# name -> "module:class"; a model's class takes no arguments.
_COST_MODELS = {
    "pipedream": "pipetrain.plan.costs_pipedream:PipeDreamCostModel",
    "pipetrain": "pipetrain.plan.costs_pipetrain:PipetrainCostModel",
}

COST_MODEL_NAMES = tuple(_COST_MODELS)
"""Every cost model name, built or not."""

DEFAULT_COST_MODEL = "pipetrain"
"""The model ``pipetrain plan`` uses unless told."""


def get_cost_model(name: str) -> CostModel:
    """The cost model called ``name``; ValueError naming the known ones otherwise.

    Example:
        >>> type(get_cost_model("pipedream")).__name__
        'PipeDreamCostModel'
    """
    if name not in _COST_MODELS:
        raise ValueError(
            f"unknown cost model {name!r}; known: {', '.join(COST_MODEL_NAMES)} "
            f"(e.g. --cost-model {DEFAULT_COST_MODEL})"
        )
    module_name, _, class_name = _COST_MODELS[name].partition(":")
    module = importlib.import_module(module_name)
    return cast(CostModel, getattr(module, class_name)())
