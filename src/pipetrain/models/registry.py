"""The model registry: reference models by name, as layer factories and ties.

Example:
    >>> factories = get_model_factories("mlp", seed=0, width=8, depth=3)
    >>> len(factories), get_model_ties("gpt", num_layers=2)
    (3, [((0, 'token.weight'), (3, 'proj.weight'))])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipetrain.models.factory import LayerFactory, Tie
from pipetrain.models.gpt import GPTConfig, gpt_layer_factories, gpt_ties
from pipetrain.models.mlp import mlp_layer_factories
from pipetrain.models.resnet import ResNetConfig, resnet_layer_factories

__all__ = ["MODELS", "get_model_factories", "get_model_ties"]


def _gpt(*, seed: int, **kwargs: Any) -> list[LayerFactory]:
    return gpt_layer_factories(GPTConfig(**kwargs), seed=seed)


def _resnet(*, seed: int, **kwargs: Any) -> list[LayerFactory]:
    return resnet_layer_factories(ResNetConfig(**kwargs), seed=seed)


MODELS: dict[str, Callable[..., list[LayerFactory]]] = {
    "gpt": _gpt,
    "mlp": mlp_layer_factories,
    "resnet": _resnet,
}
"""Model name -> function of ``(*, seed, **options)`` returning its layer factories."""

_TIES: dict[str, Callable[..., list[Tie]]] = {
    "gpt": lambda **kwargs: gpt_ties(GPTConfig(**kwargs)),
}


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)}")


def get_model_factories(name: str, *, seed: int, **kwargs: Any) -> list[LayerFactory]:
    """The layer factories of model ``name``; ``kwargs`` are its configuration fields.

    Example:
        >>> [type(f()).__name__ for f in get_model_factories("gpt", seed=0, num_layers=1, width=32)]
        ['Embedding', 'Block', 'Head']
    """
    _check_name(name)
    return MODELS[name](seed=seed, **kwargs)


def get_model_ties(name: str, **kwargs: Any) -> list[Tie]:
    """The tied parameters of model ``name`` (see :func:`pipetrain.models.gpt.gpt_ties`).

    Example:
        >>> get_model_ties("resnet")
        []
    """
    _check_name(name)
    return _TIES[name](**kwargs) if name in _TIES else []
