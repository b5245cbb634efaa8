"""Gradient buffers kept from one step to the next, on the CPU.

A CPU has no caching allocator: a fresh gradient buffer comes from the operating
system, and its first write page-faults through every byte of it (about a third of a
millisecond per MiB here, on the critical path of the first backward of each step).
:class:`GradientPool` keeps the buffers instead:

- :meth:`~GradientPool.release` takes back the ``.grad`` of weights after an optimizer
  step (the multi-process runtime does this in place of ``zero_grad()``);
- with ``reuse_dropped=True`` (opt-in), :meth:`~GradientPool.lend` remembers the buffer
  the first accumulation of a step put in ``.grad``; once the user's ``zero_grad()``
  (``set_to_none=True``, torch's default) has dropped that tensor, the next step writes
  into its memory again.

Keeping a buffer the user dropped costs memory between steps (the gradients' size, held
while the next forward runs), so it is off unless asked for. Whether the user still holds
a dropped gradient is told by a weak reference to the tensor handed out: it dies only
when no Python variable, no ``.grad`` and no view of it is left. A tensor that shares the
memory without referring to the tensor (``.detach()``, ``.data``, ``.numpy()``,
``untyped_storage()``) is not seen: with ``reuse_dropped=True``, do not keep such aliases
of a gradient across ``zero_grad()`` (copy it, ``.clone()``, instead).

Only CPU buffers are kept this way: CUDA's caching allocator already reuses memory.
"""

from __future__ import annotations

import weakref
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
        >>> pool = GradientPool(reuse_dropped=True)
        >>> w.grad = torch.ones(2, 2)
        >>> pool.lend(w, w.grad)   # the first accumulation of a step made this buffer
        >>> w.grad = None          # zero_grad(): nothing refers to that tensor now
        >>> pool.take(w) is not None
        True
    """

    def __init__(self, *, reuse_dropped: bool = False) -> None:
        self.reuse_dropped = reuse_dropped
        """whether :meth:`lend` keeps buffers to reuse once the user dropped them"""
        self._kept: dict[int, torch.Tensor] = {}
        self._lent: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """Keep the ``.grad`` of ``params`` and set it to ``None``."""
        for param in params:
            if param.grad is not None:
                self._lent.pop(id(param), None)
                self._kept[id(param)] = param.grad
                param.grad = None

    def lend(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``buffer`` became ``param.grad``: with :attr:`reuse_dropped`, take its memory
        back once nobody refers to ``buffer`` (CPU only); otherwise nothing."""
        if self.reuse_dropped and buffer.device.type == "cpu":
            # the pool's own tensor over the memory; it does not keep ``buffer`` alive
            self._lent[id(param)] = (weakref.ref(buffer), buffer.detach())

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer that fits ``param``'s gradient, if any."""
        buffer = self._kept.pop(id(param), None)
        if buffer is None:
            lent = self._lent.pop(id(param), None)
            if lent is None or lent[0]() is not None:
                return None  # nothing lent, or the user still holds it: theirs now
            buffer = lent[1]
        if buffer.shape != param.shape or buffer.dtype != param.dtype:
            return None
        return buffer

    def __len__(self) -> int:
        """The number of buffers held (kept or lent)."""
        return len(self._kept) + len(self._lent)
