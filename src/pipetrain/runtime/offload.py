"""Activation offload: a stage keeps a budget of saved activations on its device and moves
the rest to host memory until its backward needs them.

A schedule holds a stage's activations from its forward to its backward (``B``, or ``W``
when split); on the first stages of a 1F1B pipeline that is up to ``K`` micro-batches.
PipeOffload (Wan et al., ICML 2025) moves what a stage saves for backward to host memory
and brings it back before the backward; since a schedule is known in advance, the copy
back can start one action ahead and overlap the action before it.

:class:`ActivationOffload` does it with torch's ``saved_tensors_hooks`` around a stage's
forward: every saved tensor (not a parameter, at least :data:`MIN_BYTES`) is kept on the
device while the stage's kept bytes stay within ``budget``, else copied to host memory
(on a GPU: pinned memory, on a side stream, the device copy freed once the copy is
done). :meth:`~ActivationOffload.prefetch` starts the copies back of one micro-batch (on
a GPU: on the side stream; the backward waits for them); an unpack that finds no
prefetched copy copies it back then. On the CPU the host is the device: the path runs
(budget, bookkeeping, prefetch) and moves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MIN_BYTES", "ActivationOffload"]

MIN_BYTES = 1 << 16
"""Saved tensors smaller than this (64 KiB) stay on the device: a copy costs more than it
saves."""


@dataclass
class _Saved:
    """One saved tensor: kept on the device (``home is None``) or offloaded."""

    tensor: torch.Tensor
    """the tensor itself (kept), or its host copy (offloaded)"""
    home: torch.device | None = None
    back: torch.Tensor | None = None
    """the device copy brought back (offloaded tensors), until the micro-batch ends"""
    ready: Any = None
    """a CUDA event the copy back records (``None``: ready)"""


class ActivationOffload:
    """Saved activations of one stage: ``budget`` bytes kept on the device, the rest offloaded.

    Example:
        >>> layer = torch.nn.Linear(256, 256)
        >>> offload = ActivationOffload(0, device=torch.device("cpu"), params=layer.parameters())
        >>> x = torch.randn(128, 256, requires_grad=True)
        >>> with offload.saving(0):
        ...     y = torch.nn.functional.gelu(layer(x))
        >>> offload.offloaded_bytes  # x (saved by the matmul) and layer(x) (by the gelu)
        262144
        >>> offload.prefetch(0)
        >>> y.sum().backward()
        >>> offload.release(0)
        >>> offload.resident_bytes, x.grad.shape
        (0, torch.Size([128, 256]))
    """

    def __init__(self, budget: int, *, device: torch.device,
                 params: Iterable[torch.Tensor] = ()) -> None:
        if budget < 0:
            raise ValueError(f"offload budget {budget} bytes is negative; fix: 0 (offload "
                             "every saved activation) or the bytes a stage keeps on its device")
        self.budget = budget
        self.device = device
        # FSDP's parameters are DTensors: their local shards are what a forward might save
        self._params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage()
                        .data_ptr() for p in params}
        self._saved: dict[int, list[_Saved]] = {}
        self._kept: dict[int, int] = {}
        self.resident_bytes = 0
        """Bytes of saved activations kept on the device now (within :attr:`budget`)."""
        self.offloaded_bytes = 0
        """Bytes moved to host memory so far (all micro-batches, cumulative)."""
        self._stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                        if device.type == "cuda" else None)

    @contextlib.contextmanager
    def saving(self, microbatch: int) -> Iterator[None]:
        """Inside: the tensors autograd saves for ``microbatch``'s backward go through the
        budget (kept, or offloaded)."""
        saved = self._saved.setdefault(microbatch, [])
        self._kept.setdefault(microbatch, 0)

        def pack(tensor: torch.Tensor) -> _Saved:
            size = tensor.numel() * tensor.element_size()
            if (size < MIN_BYTES or tensor.untyped_storage().data_ptr() in self._params):
                return _Saved(tensor)
            if self.resident_bytes + size <= self.budget:
                self.resident_bytes += size
                self._kept[microbatch] += size
                return _Saved(tensor)
            entry = _Saved(self._to_host(tensor), home=tensor.device)
            saved.append(entry)
            self.offloaded_bytes += size
            return entry

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            return tensor  # the host is the device: nothing to move
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # its memory is reused only once copied
        return host

    def _fetch(self, entry: _Saved) -> None:
        if self._stream is None or entry.home is None:
            entry.back = entry.tensor
            return
        with torch.cuda.stream(self._stream):
            entry.back = entry.tensor.to(entry.home, non_blocking=True)
            entry.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            entry.ready.record(self._stream)

    def _unpack(self, entry: _Saved) -> torch.Tensor:
        if entry.home is None:
            return entry.tensor
        if entry.back is None:
            self._fetch(entry)
        assert entry.back is not None
        if entry.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.ready)
            entry.back.record_stream(current)
            entry.ready = None
        return entry.back

    def prefetch(self, microbatch: int) -> None:
        """Start bringing ``microbatch``'s offloaded tensors back (its backward is next)."""
        for entry in self._saved.get(microbatch, ()):
            if entry.back is None:
                self._fetch(entry)

    def release(self, microbatch: int) -> None:
        """``microbatch``'s backward is over: its kept bytes leave the budget, its copies go."""
        self.resident_bytes -= self._kept.pop(microbatch, 0)
        self._saved.pop(microbatch, None)

    def clear(self) -> None:
        """Forget every micro-batch (a failed step)."""
        self._saved.clear()
        self._kept.clear()
        self.resident_bytes = 0
