"""Automatic balancing: measure each layer, then cut the model evenly by that cost.

torchgpipe-compatible (``torchgpipe.balance.balance_by_time`` / ``balance_by_size``),
and working on the CPU as well as on CUDA. Both are thin: torchgpipe's checks of their
arguments, the profiler's per-layer costs (:mod:`pipetrain.plan.layer_costs`), then the
one min-max solver (:func:`pipetrain.plan.contiguous.solve`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, SupportsIndex

import torch
from torch import nn

from pipetrain.counts import whole_number
from pipetrain.partition.split import verify_module
from pipetrain.plan.contiguous import solve
from pipetrain.plan.layer_costs import profile_sizes, profile_times
from pipetrain.plan.profiler_inputs import default_device

__all__ = ["balance_by_size", "balance_by_time"]

Device = torch.device | str | int


def _resolve(device: Device | None) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _check_partitions(partitions: int, module: nn.Sequential) -> None:
    """torchgpipe's checks (and phrases) on ``partitions``, then :func:`verify_module`."""
    if not isinstance(module, nn.Sequential):
        verify_module(module)  # the TypeError
    num_layers = len(module)
    fix = f"fix: e.g. balance_by_time({max(1, min(2, num_layers))}, model, sample)"
    if isinstance(partitions, bool) or not isinstance(partitions, SupportsIndex):
        raise TypeError(
            f"partitions must be a positive integer (the number of partitions), got "
            f"{partitions!r} ({type(partitions).__name__}); {fix}"
        )
    count = operator.index(partitions)
    if count < 1:
        raise ValueError(f"partitions must be a positive integer ({count} < 1); {fix}")
    if num_layers < count:
        fewer = (f"balance_by_time({num_layers}, model, sample) or fewer" if num_layers else
                 "add the model's layers, nn.Sequential(layer1, layer2, ...)")
        raise ValueError(
            f"sequence is shorter than intended partitions ({num_layers} < {count}): the "
            f"module has {num_layers} layers and each partition needs at least one; fix: "
            f"{fewer}"
        )
    verify_module(module)


def _check_no_gradients(module: nn.Module) -> None:
    holding = [name for name, p in module.named_parameters() if p.grad is not None]
    if holding:
        shown = ", ".join(repr(name) for name in holding[:5])
        more = f" and {len(holding) - 5} more" if len(holding) > 5 else ""
        raise ValueError(
            f"some parameter already has gradient: {shown}{more}; balance_by_time times "
            f"backward passes from a model without gradients (as torchgpipe does); fix: "
            f"model.zero_grad(set_to_none=True) before balancing"
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
        TypeError: ``module`` is not an ``nn.Sequential``, or ``partitions`` is not
            an integer.
        ValueError: ``partitions`` is not between 1 and ``len(module)``, or a
            parameter of ``module`` already has a gradient (``.grad`` is not None), as
            torchgpipe refuses it: call ``model.zero_grad(set_to_none=True)`` first.

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
    _check_no_gradients(module)
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

    A layer's size is the memory its activations take on one micro-batch (``input``
    is the mini-batch you will train with, split in ``chunks``) plus its parameter
    bytes times ``param_scale``: 2 covers weights and gradients (SGD without
    momentum); use 3 for SGD with momentum, 4-5 for Adam. Sizes are weighed as
    torchgpipe's CUDA profiler weighs them (see
    :func:`~pipetrain.plan.layer_costs.profile_sizes`), on any device: ``device``
    defaults to CUDA if available, else the CPU. The module is not changed.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or ``partitions`` /
            ``chunks`` / ``param_scale`` is not a number.
        ValueError: ``partitions`` is not between 1 and ``len(module)``, ``chunks``
            is not a positive whole number, or ``param_scale`` is negative.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1000), nn.Linear(1000, 4))
        >>> balance_by_size(2, model, torch.randn(8, 4), device="cpu")
        [2, 1]
    """
    _check_partitions(partitions, module)
    num_chunks = whole_number(chunks)
    if num_chunks is None or num_chunks < 1:
        raise ValueError(
            f"chunks must be a positive integer (the micro-batches you will train with), "
            f"got {chunks!r}; fix: e.g. balance_by_size({partitions}, model, input, "
            f"chunks=8) for GPipe(model, balance, chunks=8)"
        )
    if isinstance(param_scale, bool) or not isinstance(param_scale, (int, float)):
        raise TypeError(f"param_scale must be a number, got {param_scale!r}; fix: "
                        f"param_scale=2.0 (SGD), 4.0 (Adam)")
    if not (math.isfinite(param_scale) and param_scale >= 0):
        raise ValueError(f"param_scale must be a finite number >= 0, got {param_scale!r}; "
                         f"fix: param_scale=2.0 (SGD), 4.0 (Adam)")
    sizes = profile_sizes(
        module, input, chunks=num_chunks, param_scale=param_scale, device=_resolve(device)
    )
    return solve(sizes, partitions)
