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
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.microbatch import split_batch
from pipetrain.nested import map_tensors

__all__ = ["default_device", "profile_sizes", "profile_times"]


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


class _SavedBytes:
    """Saved-tensor hooks adding up the distinct storages a layer saves for backward."""

    def __init__(self, layer: nn.Module) -> None:
        self._own = {_storage_key(t)[0] for t in (*layer.parameters(), *layer.buffers())}
        self._saved: dict[int, int] = {}

    def pack(self, tensor: Tensor) -> Tensor:
        address, nbytes = _storage_key(tensor)
        if address not in self._own:
            self._saved[address] = nbytes
        return tensor

    def unpack(self, tensor: Tensor) -> Tensor:
        return tensor

    def total(self) -> int:
        return sum(self._saved.values())


def profile_sizes(
    module: nn.Sequential,
    input: Any,
    *,
    chunks: int,
    param_scale: float,
    device: torch.device,
) -> list[int]:
    """Bytes each layer needs in training: its activations plus scaled parameters.

    Activations are the distinct storages the layer saves for backward (seen through
    ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) on one
    micro-batch of ``input`` split in ``chunks``; parameters count ``param_scale``
    times (weights, gradients, optimizer state), buffers once.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> profile_sizes(model, torch.randn(8, 4, requires_grad=True), chunks=2,
        ...               param_scale=2.0, device=torch.device("cpu"))
        [224, 64]
    """
    # _detached copies: a view into the whole batch would count the whole batch's storage.
    batch = _detached(split_batch(input, chunks)[0], device)
    sizes: list[int] = []
    with torch.enable_grad():
        for layer in _layer_copies(module, device):
            saved = _SavedBytes(layer)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                output = layer(batch)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
            sizes.append(int(saved.total() + params * param_scale + buffers))
            batch = _detached(output, device)
    return sizes
