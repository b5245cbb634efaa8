"""Per-layer measurements for balancing: time of forward + backward, and memory bytes.

Each layer is run on a deep copy placed on the profiling device (copied layer by
layer, so the whole model never has to fit there), in training mode, feeding each
layer the previous layer's output. The module itself is left untouched: its
parameters, gradients, buffers (batch norm statistics) and device stay as they were.
Layers run in order in the calling thread, so skip connections between them work as
in a plain forward.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.microbatch import batch_size
from pipetrain.nested import iter_tensors, map_tensors

__all__ = ["cuda_block_bytes", "default_device", "profile_sizes", "profile_times"]

_logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """CUDA (the current device) if available, else the CPU.

    Example:
        >>> default_device().type in ("cpu", "cuda")
        True
    """
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _fresh(tensor: Tensor, device: torch.device) -> Tensor:
    # A copy, so that a layer working in place changes neither the caller's sample nor an
    # earlier layer's output (which a skip connection may still use); and, where grad is
    # needed, a non-leaf, so that in-place layers (ReLU(inplace=True)) may run on it.
    copy = tensor.detach().to(device, copy=True)
    return copy.requires_grad_().clone() if tensor.requires_grad else copy


def _detached(batch: Any, device: torch.device) -> Any:
    """A copy of the batch on ``device``, cut from any graph, still needing grad where
    it did."""
    return map_tensors(lambda t: _fresh(t, device), batch)


def _layer_copies(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    for layer in module:
        yield copy.deepcopy(layer).to(device).train()


def _backward(output: Any) -> None:
    tensors: list[Tensor] = []
    map_tensors(lambda t: tensors.append(t) if t.requires_grad else None, output)
    if tensors:
        # retain_graph: a skip tensor stashed by an earlier layer may be popped later
        # and backpropagated through again.
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors],
                                retain_graph=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_times(
    module: nn.Sequential, sample: Any, *, timeout: float, device: torch.device
) -> list[float]:
    """Seconds of forward + backward of each layer on ``sample`` (median over passes).

    Passes over the whole module are repeated until ``timeout`` seconds have gone by
    (at least one pass).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> times = profile_times(model, torch.randn(4, 8), timeout=0.0,
        ...                       device=torch.device("cpu"))
        >>> len(times), all(t >= 0 for t in times)
        (2, True)
    """
    samples: list[list[float]] = [[] for _ in module]
    started = time.perf_counter()
    with torch.enable_grad():
        while True:
            batch = _detached(sample, device)
            for i, layer in enumerate(_layer_copies(module, device)):
                _synchronize(device)
                tick = time.perf_counter()
                output = layer(batch)
                _backward(output)
                _synchronize(device)
                samples[i].append(time.perf_counter() - tick)
                batch = _detached(output, device)
            if time.perf_counter() - started >= timeout:
                break
    return [statistics.median(values) for values in samples]


def _storage_key(tensor: Tensor) -> tuple[int, int]:
    """(storage address, bytes) of what keeping ``tensor`` alive keeps alive."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return id(tensor), tensor.numel() * tensor.element_size()


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes that CUDA's caching allocator books for an allocation of ``nbytes``.

    Allocations are made in blocks of 512 bytes, so ``torch.cuda.memory_allocated``
    (what torchgpipe's size profiler reads) grows by at least 512 bytes per tensor.

    Example:
        >>> cuda_block_bytes(0), cuda_block_bytes(4), cuda_block_bytes(4000)
        (0, 512, 4096)
    """
    return -(-nbytes // 512) * 512


class _Saved:
    """Saved-tensor hooks keeping what a layer saves for backward (to weigh it)."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def pack(self, tensor: Tensor) -> Tensor:
        self.tensors.append(tensor)
        return tensor

    def unpack(self, tensor: Tensor) -> Tensor:
        return tensor


def _first_rows(batch: Any, rows: int) -> Any:
    return map_tensors(lambda t: t[:rows] if t.dim() > 0 else t, batch)


def _latent_bytes(layer: nn.Module, batch: Any) -> tuple[int, Any]:
    """(bytes a forward of ``layer`` leaves allocated, its output).

    What stays allocated after the forward: the output and the tensors saved for
    backward, each distinct storage counted once in CUDA's 512-byte blocks, leaving
    out the storages that existed before (the input, parameters and buffers), as
    ``torch.cuda.memory_allocated`` after minus before counts them.
    """
    before = {_storage_key(t)[0] for t in (*iter_tensors(batch), *layer.parameters(),
                                           *layer.buffers())}
    saved = _Saved()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        output = layer(batch)
    alive = dict(_storage_key(t) for t in (*iter_tensors(output), *saved.tensors))
    latent = sum(cuda_block_bytes(n) for address, n in alive.items() if address not in before)
    return latent, output


def profile_sizes(
    module: nn.Sequential,
    input: Any,
    *,
    chunks: int,
    param_scale: float,
    device: torch.device,
) -> list[int]:
    """Bytes each layer needs in training, weighed as torchgpipe weighs them on CUDA.

    Each layer runs (in training mode, on a copy) on one sample: the first row of
    every batch tensor of ``input``, fed the previous layer's output. Its *latent*
    size is the memory that forward leaves allocated (output and saved tensors, new
    storages only, in CUDA's 512-byte blocks), scaled to one micro-batch by
    ``batch size / chunks``; its parameters count ``param_scale`` times their bytes.
    This is what torchgpipe's ``balance_by_size`` reads from
    ``torch.cuda.memory_allocated``, computed from the tensors themselves, so the
    weights (and the balance) are the same on the CPU as on CUDA. Buffers are not
    counted, as in torchgpipe. A model with a layer that cannot run on one sample in
    training (``BatchNorm1d`` on ``(N, C)`` inputs, which torchgpipe cannot profile)
    is weighed on two samples, halved.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> # Linear: a 16-byte output row in a 512-byte block, x 8 rows / 2 chunks,
        >>> # plus 2 x 80 parameter bytes; ReLU: its output row (which it saves)
        >>> profile_sizes(model, torch.randn(8, 4, requires_grad=True), chunks=2,
        ...               param_scale=2.0, device=torch.device("cpu"))
        [2208, 2048]
    """
    size = batch_size(input)
    try:
        measured = _measure(module, _first_rows(input, 1), device)
    except Exception as error:  # e.g. BatchNorm1d on (1, C): needs more than one row
        if size < 2:
            raise
        _logger.info("a layer cannot run on one sample (%s); weighing two samples, "
                     "per sample", error)
        measured = [(latent / 2, params)
                    for latent, params in _measure(module, _first_rows(input, 2), device)]
    latent_scale = size / chunks
    return [int(latent * latent_scale + params * param_scale) for latent, params in measured]


def _measure(module: nn.Sequential, sample: Any, device: torch.device) -> list[tuple[float, int]]:
    """(latent bytes, parameter bytes) of each layer, run on ``sample`` in order."""
    batch = _detached(sample, device)
    measured: list[tuple[float, int]] = []
    with torch.enable_grad():
        for layer in _layer_copies(module, device):
            latent, output = _latent_bytes(layer, batch)
            params = sum(_storage_key(p)[1] for p in layer.parameters())
            measured.append((latent, params))
            batch = _detached(output, device)
    return measured
