"""Gradient buffers kept from one step to the next.

The multi-process runtime ends a step with :meth:`GradientPool.release` in place of
``zero_grad()``: it takes back the ``.grad`` of the weights whose gradient a fused
accumulation made (:mod:`.split`, :mod:`.fused`), and the next step's first fused
accumulation writes into that buffer (``torch.mm(..., out=buffer)``) instead of a fresh
one. Every other gradient is dropped, as ``zero_grad()`` drops it: autograd makes a fresh
one next step, and a kept copy would only add its size to the peak. On a CPU, which has
no caching allocator, a fresh buffer page-faults through every byte on its first write;
on a GPU the write simply needs no allocation.

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
        >>> w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
        >>> w.grad, b.grad = torch.ones(2, 2), torch.ones(2)
        >>> pool = GradientPool()
        >>> pool.lend(w, w.grad)   # a fused accumulation made w's gradient, autograd b's
        >>> pool.release([w, b])
        >>> w.grad is None and b.grad is None, len(pool), pool.take(w).shape
        (True, 1, torch.Size([2, 2]))
        >>> pool.take(w) is None   # handed out once
        True
    """

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}
        self._fused: set[int] = set()
        """the parameters whose gradient a fused accumulation made since the last release"""

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """Set the ``.grad`` of ``params`` to ``None``, keeping those a fused accumulation
        made (the only ones a later step takes back); what the last step left untaken
        is dropped too."""
        self._kept.clear()
        for param in params:
            if param.grad is not None:
                if id(param) in self._fused:
                    self._kept[id(param)] = param.grad
                param.grad = None
        self._fused.clear()

    def lend(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``buffer`` became ``param.grad`` by a step's first (fused) accumulation: the
        next :meth:`release` keeps it."""
        self._fused.add(id(param))

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer that fits ``param``'s gradient, if any (handed out once)."""
        buffer = self._kept.pop(id(param), None)
        if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
            return None
        return buffer

    def __len__(self) -> int:
        """The number of buffers held."""
        return len(self._kept)
