"""Gradient buffers kept from one step to the next, on the CPU.

A CPU has no caching allocator: a fresh gradient buffer comes from the operating
system, and its first write page-faults through every byte of it (about a third of a
millisecond per MiB here, on the critical path of the first backward of each step).
:class:`GradientPool` keeps the buffers instead:

- :meth:`~GradientPool.release` takes back the ``.grad`` of weights after an optimizer
  step (the multi-process runtime does this in place of ``zero_grad()``);
- :meth:`~GradientPool.lend` remembers the buffer the first accumulation of a step put
  in ``.grad``; once the user's ``zero_grad()`` (``set_to_none=True``, torch's default)
  has dropped it and *nothing else* refers to it or to its memory, the next step writes
  into it again. A buffer someone still holds (a saved ``p.grad``, a view of it) is left
  to them.

Only CPU buffers are kept this way: CUDA's caching allocator already reuses memory.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

__all__ = ["GradientPool"]


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is referenced only by the caller's one local variable: no other
    Python reference, no other C++ owner (``.grad`` of a weight, an autograd graph) and
    no view of its memory."""
    try:
        storage_owners = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        owners = tensor._use_count()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # a torch without these counters: never reuse
        return False
    # Python: the caller's variable, this argument, getrefcount's argument; storage: the
    # tensor and the temporary storage object made by untyped_storage() above
    return sys.getrefcount(tensor) <= 3 and owners == 1 and storage_owners <= 2


class GradientPool:
    """Gradient buffers kept from one step to the next.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> w.grad = torch.ones(2, 2)
        >>> pool = GradientPool()
        >>> pool.release([w])
        >>> w.grad is None, pool.take(w).shape
        (True, torch.Size([2, 2]))
        >>> w.grad = torch.ones(2, 2)
        >>> pool.lend(w, w.grad)   # the first accumulation of a step made this buffer
        >>> w.grad = None          # zero_grad(): nothing else holds it now
        >>> pool.take(w) is not None
        True
    """

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}
        self._lent: dict[int, torch.Tensor] = {}

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """Keep the ``.grad`` of ``params`` and set it to ``None``."""
        for param in params:
            if param.grad is not None:
                self._lent.pop(id(param), None)
                self._kept[id(param)] = param.grad
                param.grad = None

    def lend(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``buffer`` became ``param.grad``: take it back once nobody holds it (CPU only)."""
        if buffer.device.type == "cpu":
            self._lent[id(param)] = buffer

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer that fits ``param``'s gradient, if any."""
        buffer = self._kept.pop(id(param), None)
        if buffer is None:
            buffer = self._lent.pop(id(param), None)
            if buffer is not None and not _unshared(buffer):
                return None  # the user kept it (or a view of it): theirs now
        if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
            return None
        return buffer
