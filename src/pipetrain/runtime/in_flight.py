"""What a pipeline stage keeps of a micro-batch between its forward and its backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.backward.roots import Root

__all__ = ["InFlight", "announce"]


@dataclass
class InFlight:
    """The autograd state of one micro-batch of a stage, from its forward to its backward."""

    inputs: list[torch.Tensor]
    """received leaves that require grad, in message order"""
    outputs: list[Root | None]
    """per output tensor announced as needing a gradient (message order): where its
    backward starts (its gradient edge: the graph, not the output's data), ``None`` if it
    turned out to need none; until a checkpointed micro-batch is rebuilt, all ``None``"""
    loss: torch.Tensor | None
    replay: tuple[Any, Any, float | None] | None = None
    """(message, target, loss scale) of a checkpointed micro-batch not yet recomputed"""
    layer_inputs: tuple[list[Any], Any, float | None] | None = None
    """(every layer's input, target, loss scale) of a micro-batch of a per-layer stage"""


def announce(tensor: torch.Tensor, differentiable: bool) -> bool:
    """Whether a checkpointed output is announced as needing a gradient.

    Example:
        >>> announce(torch.ones(1), True), announce(torch.ones(1, dtype=torch.long), True)
        (True, False)
    """
    return differentiable and (tensor.is_floating_point() or tensor.is_complex())
