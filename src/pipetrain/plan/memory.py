"""The bytes a layer holds: storages counted once, tensors saved for backward, optimizer state.

Sizes are counted per *storage* (the memory block a tensor and all its views share), so
a tensor saved twice, or saved together with a view of it, counts once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from types import TracebackType

import torch
from torch import Tensor, nn

__all__ = [
    "OPTIMIZERS",
    "OptimizerFactory",
    "SavedTensors",
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


def storage_bytes(
    tensors: Iterable[Tensor], *, exclude: AbstractSet[tuple[str, int]] = frozenset()
) -> int:
    """Bytes of the distinct storages under ``tensors`` (each counted once), except ``exclude``.

    Example:
        >>> x = torch.zeros(4, 4)
        >>> storage_bytes([x, x[0], x.t()]), storage_bytes([x], exclude={storage_key(x)})
        (64, 0)
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
