"""Gradients between a single-process pipeline and its caller, cut and joined by micro-batch.

The caller's backward hands :class:`~pipetrain.api.local_step.LocalPipeline` the gradient
of each merged output: :func:`split_grad` cuts it into the micro-batches' pieces (views).
The first stage returns the gradients of its micro-batches' inputs: :func:`merge_grads`
joins them into the gradient of the caller's input.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["merge_grads", "rows", "split_grad"]


def rows(tensor: torch.Tensor) -> int:
    """The rows (batch entries) of a micro-batch's piece; ``-1`` for a 0-dim tensor.

    Example:
        >>> rows(torch.zeros(3, 2)), rows(torch.tensor(1.0))
        (3, -1)
    """
    return tensor.shape[0] if tensor.dim() > 0 else -1


def split_grad(grad: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
    """The pieces of a merged output's gradient, ``sizes[i]`` rows for micro-batch ``i``.

    Example:
        >>> [p.shape[0] for p in split_grad(torch.zeros(5, 2), [3, 2])]
        [3, 2]
    """
    if grad is None:
        return [None] * len(sizes)
    if sizes and sizes[0] == -1:
        # a 0-dim output is the first micro-batch's (merge_batches): so is its gradient
        return [grad] + [None] * (len(sizes) - 1)
    return list(torch.split(grad, sizes))


def merge_grads(pieces: list[Any], shape: torch.Size, sizes: list[int]) -> torch.Tensor | None:
    """The gradient of an input of shape ``shape`` from its micro-batches' pieces (a
    missing piece is zeros of ``sizes[i]`` rows; a 0-dim input's pieces add up).

    Example:
        >>> merge_grads([torch.ones(1, 2), None], torch.Size([3, 2]), [1, 2]).tolist()
        [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if all(p is None for p in pieces):
        return None
    if len(shape) == 0:  # shared across micro-batches: gradients add up
        return torch.stack([p for p in pieces if p is not None]).sum(0)
    template = next(p for p in pieces if p is not None)
    filled = [p if p is not None else template.new_zeros((n, *shape[1:]))
              for p, n in zip(pieces, sizes)]
    return torch.cat(filled) if len(filled) > 1 else filled[0]
