"""Hugging Face specifics: the key-value cache, and the model's own weight initialization.

Nothing here imports ``transformers``: a Hugging Face model is recognised by what it has
(a ``config`` and an ``_init_weights`` method, as every ``PreTrainedModel``).

* ``use_cache``: a causal language model returns its key-value cache (an object for
  generation, which training does not use) unless ``use_cache=False``. When the example
  inputs leave it out, pipetrain passes ``use_cache=False`` (logged); an explicit
  ``use_cache=True`` is refused with the fix.
* Initialization: a stage materialized from the meta device is initialized module by
  module with the model's ``_init_weights`` (what ``post_init`` applies to every
  module), its ties kept.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["is_hf_model", "module_initializer", "training_kwargs"]

logger = logging.getLogger(__name__)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` looks like a Hugging Face ``PreTrainedModel``.

    Example:
        >>> is_hf_model(nn.Linear(2, 2))
        False
    """
    return hasattr(model, "config") and callable(getattr(model, "_init_weights", None))


def training_kwargs(model: nn.Module, named: dict[str, Any]) -> dict[str, Any]:
    """``named`` with the cache turned off for training (see the module docstring).

    Raises:
        ValueError: ``use_cache=True`` was asked for.

    Example:
        >>> training_kwargs(nn.Linear(2, 2), {"input": 1})
        {'input': 1}
    """
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters or (
        is_hf_model(model) and hasattr(model.config, "use_cache"))
    if not takes_cache:
        return named
    if named.get("use_cache") is True:
        raise ValueError(
            f"use_cache=True: {type(model).__name__} would return its key-value cache (a "
            "cache object for generation) from every stage, which training does not use "
            "and a pipeline cannot send; fix: example_kwargs={'use_cache': False}, or leave "
            "use_cache out (pipetrain then turns the cache off)"
        )
    if "use_cache" not in named:
        logger.debug("%s: capturing with use_cache=False (training uses no key-value cache)",
                     type(model).__name__)
        return {**named, "use_cache": False}
    return named


def module_initializer(model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """The model's own initialization of one module (its direct parameters), or ``None``
    for a model without one: Hugging Face's ``_init_weights``; else each module's
    ``reset_parameters`` (see :func:`pipetrain.frontend.materialize.initialize`).

    The returned function returns whether it initialized the module.
    """
    if is_hf_model(model):
        init_weights: Callable[[nn.Module], Any] = getattr(model, "_init_weights")  # noqa: B009

        def hf_init(module: nn.Module) -> bool:
            init_weights(module)
            return True

        return hf_init
    return None
