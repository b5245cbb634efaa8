"""MLP: a stack of equal ``Linear(width, width) + activation`` layers, for benchmarks.

Every layer maps (B, width) -> (B, width) and costs the same, so any split of the stack
into stages is balanced: the simplest model to pipeline.
"""

from __future__ import annotations

import functools

from torch import nn

from pipetrain.models.factory import LayerFactory, build_sequential, seeded

__all__ = ["ACTIVATIONS", "build_mlp", "mlp_layer", "mlp_layer_factories"]

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU}
"""Activation name -> module class."""


def _check(*, width: int, depth: int, activation: str) -> None:
    problems = []
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        problems.append(f"width={width!r} must be a positive int, e.g. width=512")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        problems.append(f"depth={depth!r} must be a positive int, e.g. depth=8")
    if activation not in ACTIVATIONS:
        problems.append(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
    if problems:
        raise ValueError("invalid MLP: " + "; ".join(problems))


def mlp_layer(*, width: int, activation: str = "relu", seed: int, index: int) -> nn.Sequential:
    """Layer ``index``: ``Sequential(Linear(width, width), activation)``, seeded by ``(seed, index)``.

    Example:
        >>> mlp_layer(width=4, activation="gelu", seed=0, index=0)
        Sequential(
          (0): Linear(in_features=4, out_features=4, bias=True)
          (1): GELU(approximate='none')
        )
    """
    _check(width=width, depth=1, activation=activation)
    return seeded(
        lambda: nn.Sequential(nn.Linear(width, width), ACTIVATIONS[activation]()),
        seed=seed,
        index=index,
    )


def mlp_layer_factories(
    *, width: int, depth: int, activation: str = "relu", seed: int
) -> list[LayerFactory]:
    """``depth`` picklable factories of ``Linear(width, width) + activation`` layers.

    Example:
        >>> factories = mlp_layer_factories(width=512, depth=8, seed=0)
        >>> len(factories), factories[0]()[0].weight.shape
        (8, torch.Size([512, 512]))
    """
    _check(width=width, depth=depth, activation=activation)
    return [
        functools.partial(mlp_layer, width=width, activation=activation, seed=seed, index=index)
        for index in range(depth)
    ]


def build_mlp(*, width: int, depth: int, activation: str = "relu", seed: int) -> nn.Sequential:
    """The whole MLP in one process: (B, width) -> (B, width).

    Example:
        >>> model = build_mlp(width=1024, depth=8, activation="gelu", seed=0)
        >>> len(model)
        8
    """
    return build_sequential(
        mlp_layer_factories(width=width, depth=depth, activation=activation, seed=seed)
    )
