"""The bytes a layer holds: storages counted once, tensors saved for backward, optimizer state.

Sizes are counted per *storage* (the memory block a tensor and all its views share), so
a tensor saved twice, or saved together with a view of it, counts once; where the bytes
CUDA's caching allocator books are wanted (torchgpipe's size weights), each storage in
512-byte blocks (:func:`cuda_block_bytes`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.nested import iter_tensors

__all__ = [
    "OPTIMIZERS",
    "OptimizerFactory",
    "SavedTensors",
    "TransientBytes",
    "cuda_block_bytes",
    "graph_leaves",
    "latent_bytes",
    "optimizer_state_bytes",
    "storage_bytes",
    "storage_key",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds an optimizer over the given parameters."""

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
}
"""The optimizers known by name (plain SGD keeps no state)."""


def storage_key(tensor: Tensor) -> tuple[str, int]:
    """Identifies the memory that keeping ``tensor`` alive keeps alive: (device, address).

    Views of one tensor share their key.

    Example:
        >>> x = torch.zeros(4, 4)
        >>> storage_key(x[1]) == storage_key(x.t())
        True
    """
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return "id", id(tensor)


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes that CUDA's caching allocator books for an allocation of ``nbytes``.

    Allocations are made in blocks of 512 bytes, so ``torch.cuda.memory_allocated``
    (what torchgpipe's size profiler reads) grows by at least 512 bytes per tensor.

    Example:
        >>> cuda_block_bytes(0), cuda_block_bytes(4), cuda_block_bytes(4000)
        (0, 512, 4096)
    """
    return -(-nbytes // 512) * 512


def storage_bytes(
    tensors: Iterable[Tensor],
    *,
    exclude: AbstractSet[tuple[str, int]] = frozenset(),
    booked: Callable[[int], int] | None = None,
) -> int:
    """Bytes of the distinct storages under ``tensors`` (each counted once), except
    ``exclude``; each storage's bytes go through ``booked`` when given (e.g.
    :func:`cuda_block_bytes`).

    Example:
        >>> x = torch.zeros(4, 4)
        >>> storage_bytes([x, x[0], x.t()]), storage_bytes([x], exclude={storage_key(x)})
        (64, 0)
        >>> storage_bytes([x, torch.zeros(1)], booked=cuda_block_bytes)
        1024
    """
    sizes: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        key = storage_key(tensor)
        if key in exclude or key in sizes:
            continue
        try:
            sizes[key] = tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            sizes[key] = tensor.numel() * tensor.element_size()
    if booked is not None:
        return sum(booked(n) for n in sizes.values())
    return sum(sizes.values())


class SavedTensors:
    """Collects the tensors that autograd saves for the backward inside a ``with`` block.

    Example:
        >>> x = torch.randn(3, 4, requires_grad=True)
        >>> with SavedTensors() as saved:
        ...     y = torch.relu(x)  # saves its result
        >>> storage_bytes(saved.tensors) == 3 * 4 * 4
        True
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Tensor:
        self.tensors.append(tensor)
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, traceback)


def optimizer_state_bytes(params: list[nn.Parameter], factory: OptimizerFactory) -> int:
    """Bytes of the state one ``step()`` of ``factory(params)`` creates (it updates ``params``).

    Each storage counts once; 0-dim tensors (Adam's ``step`` counter) do not count.
    Parameters without a gradient get no state.

    Example:
        >>> layer = torch.nn.Linear(4, 2)  # 10 parameters, 40 bytes
        >>> layer(torch.ones(1, 4)).sum().backward()
        >>> optimizer_state_bytes(list(layer.parameters()), OPTIMIZERS["adam"])
        80
    """
    if not any(p.grad is not None for p in params):
        return 0
    optimizer = factory(params)
    optimizer.step()
    state = [value for per_param in optimizer.state.values() for value in per_param.values()
             if isinstance(value, Tensor) and value.dim() > 0]
    return storage_bytes(state)


def graph_leaves(outputs: Iterable[Tensor], *, inputs: Iterable[Tensor] = ()) -> list[Tensor]:
    """The leaf tensors that the autograd graphs of ``outputs`` keep alive (each node that
    accumulates a gradient holds its tensor: parameters, inputs, and tensors created with
    ``requires_grad=True`` in the forward), not looking past the graphs of ``inputs``.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> [tuple(t.shape) for t in graph_leaves([w * torch.rand(2, requires_grad=True)])]
        [(2,), (2,)]
    """
    stack: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = {t.grad_fn for t in inputs if t.grad_fn is not None}
    leaves: list[Tensor] = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
        if isinstance(variable, Tensor):
            leaves.append(variable)
        stack.extend(following for following, _ in node.next_functions)
    return leaves


def latent_bytes(layer: nn.Module, value: Any) -> tuple[int, Any]:
    """(bytes a forward of ``layer`` on ``value`` leaves allocated on CUDA, its output).

    What stays allocated after the forward: the output, the tensors saved for backward
    and the leaf tensors its graph holds (:func:`graph_leaves`: e.g. a
    ``torch.rand_like(x, requires_grad=True)`` added to the input), each distinct storage
    counted once in CUDA's 512-byte blocks, leaving out
    the storages that existed before (the input's, parameters and buffers), as
    ``torch.cuda.memory_allocated`` after minus before counts them (torchgpipe's
    ``profile_sizes``), on any device.

    Example:
        >>> x = torch.randn(1, 4, requires_grad=True)
        >>> latent, out = latent_bytes(torch.nn.Linear(4, 4), x)  # its 16-byte output
        >>> latent, tuple(out.shape)
        (512, (1, 4))
    """
    before = {storage_key(t) for t in (*iter_tensors(value), *layer.parameters(),
                                        *layer.buffers())}
    with SavedTensors() as saved:
        output = layer(value)
    outputs = list(iter_tensors(output))
    held = graph_leaves(outputs, inputs=iter_tensors(value))
    latent = storage_bytes((*outputs, *saved.tensors, *held), exclude=before,
                           booked=cuda_block_bytes)
    return latent, output


class TransientBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The most memory a region of code needs above what it starts and ends with.

    Every storage an operation creates inside the ``with`` block is counted from its
    creation until it is freed; ``released`` tensors (e.g. the activations a backward
    frees as it goes) count negatively once freed. :meth:`peak` is the highest running
    total, leaving out the storages that ``kept`` names (what outlives the region on
    purpose, e.g. the parameters' gradients, which a pipeline keeps between steps).
    Outputs that share storage with an input (in-place operations, views) are not new.

    Example:
        >>> x = torch.randn(256, 256)
        >>> with TransientBytes() as region:
        ...     y = (x * 2).sum()   # a 256 KiB temporary, freed at once
        >>> region.peak() >= 256 * 256 * 4, region.peak(kept=[y]) >= 256 * 256 * 4
        (True, True)
    """

    def __init__(self, released: Iterable[Tensor] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._events: list[tuple[int, int]] = []  # (serial, +bytes created / -bytes freed)
        self._alive: dict[int, tuple[int, Any]] = {}  # storage address -> (serial, weak ref)
        self._serials = itertools.count()
        for tensor in released:
            self._watch(tensor, created=False)

    def _watch(self, tensor: Tensor, *, created: bool) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        address = storage.data_ptr()
        if not address:  # empty: nothing held
            return
        if address in self._alive:
            return
        serial, size = next(self._serials), storage.nbytes()
        if created:
            self._events.append((serial, size))

        def freed(_: Any) -> None:
            self._alive.pop(address, None)
            self._events.append((serial, -size))

        self._alive[address] = (serial, weakref.ref(storage, freed))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in iter_tensors((args, kwargs))
                  if t.layout == torch.strided}
        for tensor in iter_tensors(out):
            if tensor.layout == torch.strided and tensor.untyped_storage().data_ptr() not in inputs:
                self._watch(tensor, created=True)
        return out

    def peak(self, kept: Iterable[Tensor] = ()) -> int:
        """The highest running total of bytes, leaving out the storages of ``kept``."""
        skip = {self._alive[address][0] for address in
                (t.untyped_storage().data_ptr() for t in kept if t is not None)
                if address in self._alive}
        total = best = 0
        for serial, change in self._events:
            if serial not in skip:
                total += change
                best = max(best, total)
        return best
