"""Automatic balancing: measure each layer, then cut the model evenly by that cost.

torchgpipe-compatible (``torchgpipe.balance.balance_by_time`` / ``balance_by_size``),
and working on the CPU as well as on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.partition.profile import default_device, profile_sizes, profile_times
from pipetrain.partition.solve import solve
from pipetrain.partition.split import verify_module

__all__ = ["balance_by_size", "balance_by_time"]

Device = torch.device | str | int


def _resolve(device: Device | None) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _check_partitions(partitions: int, module: nn.Sequential) -> None:
    verify_module(module)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not (
        1 <= partitions <= len(module)
    ):
        raise ValueError(
            f"partitions must be an integer from 1 to the number of layers "
            f"({len(module)}), got {partitions!r}; fix: e.g. balance_by_time("
            f"{min(2, len(module))}, model, sample)"
        )


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: Device | None = None,
) -> list[int]:
    """A balance of ``partitions`` that evens out each partition's forward + backward time.

    Each layer of ``module`` is timed on a copy (forward, then backward) on ``sample``
    (a tensor or nested batch), repeating passes over the model for about ``timeout``
    seconds; ``device`` defaults to CUDA if available, else the CPU. The module is
    not changed.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: ``partitions`` is not between 1 and ``len(module)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        >>> balance = balance_by_time(2, model, torch.randn(8, 16), timeout=0.0,
        ...                           device="cpu")
        >>> len(balance), sum(balance)
        (2, 4)
    """
    _check_partitions(partitions, module)
    times = profile_times(module, sample, timeout=timeout, device=_resolve(device))
    return solve(times, partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Any,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = None,
) -> list[int]:
    """A balance of ``partitions`` that evens out the memory each partition needs.

    A layer's size is the bytes it saves for backward on one micro-batch (``input``,
    the mini-batch you will train with, split in ``chunks``) plus its parameter bytes
    times ``param_scale``: 2 covers weights and gradients (SGD without momentum); use
    3 for SGD with momentum, 4-5 for Adam. ``device`` defaults to CUDA if available,
    else the CPU. The module is not changed.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: ``partitions`` is not between 1 and ``len(module)``, or
            ``chunks`` < 1.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1000), nn.Linear(1000, 4))
        >>> balance_by_size(2, model, torch.randn(8, 4), device="cpu")
        [2, 1]
    """
    _check_partitions(partitions, module)
    sizes = profile_sizes(
        module, input, chunks=chunks, param_scale=param_scale, device=_resolve(device)
    )
    return solve(sizes, partitions)
