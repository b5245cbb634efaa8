"""Gradient buffers kept from one step to the next.

The multi-process runtime ends a step with :meth:`GradientPool.release` in place of
``zero_grad()``: it takes back the ``.grad`` of the stage's weights, and the next step's
first fused accumulation (:mod:`.split`, :mod:`.fused`) writes into that buffer
(``torch.mm(..., out=buffer)``) instead of a fresh one. On a CPU, which has no caching
allocator, a fresh buffer page-faults through every byte on its first write; on a GPU
the write simply needs no allocation.

Reusing the buffers of gradients the *user* dropped (``zero_grad()`` in a single-process
``GPipe``) is a CPU tuning, asked for with ``GPipe(reuse_gradient_buffers=True)``: see
:class:`pipetrain.runtime.cpu_tuning.ReusingGradientPool`, which :meth:`GradientPool.lend`
exists for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["GradientPool"]


class GradientPool:
    """Gradient buffers kept from one step to the next.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> w.grad = torch.ones(2, 2)
        >>> pool = GradientPool()
        >>> pool.release([w])
        >>> w.grad is None, pool.take(w).shape
        (True, torch.Size([2, 2]))
        >>> pool.take(w) is None   # handed out once
        True
    """

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """Keep the ``.grad`` of ``params`` and set it to ``None``."""
        for param in params:
            if param.grad is not None:
                self._kept[id(param)] = param.grad
                param.grad = None

    def lend(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``buffer`` became ``param.grad`` by a step's first accumulation. Nothing here;
        a pool that reuses dropped gradients remembers it."""

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer that fits ``param``'s gradient, if any (handed out once)."""
        buffer = self._kept.pop(id(param), None)
        if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
            return None
        return buffer

    def __len__(self) -> int:
        """The number of buffers held."""
        return len(self._kept)
