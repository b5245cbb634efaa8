"""The profiler's inputs: the layers (modules or factories) checked and built, the
settings checked, the sample's first rows, the device, and the state measurements run in.

Example:
    >>> from torch import nn
    >>> len(layer_sources(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
    2
    >>> check_settings(8, None, 2, 0, 1, "adamw", None, None)  # fine: no error
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pipetrain.nested import map_tensors
from pipetrain.plan.memory import OPTIMIZERS

__all__ = [
    "LayerSource",
    "build_layer",
    "check_settings",
    "default_device",
    "first_rows",
    "is_whole",
    "layer_sources",
    "measuring",
]

LayerSource = nn.Module | Callable[[], nn.Module]
"""A layer, or a factory that builds one (``pipetrain.models.gpt_layer_factories``)."""


def layer_sources(layers: nn.Sequential | Iterable[LayerSource]) -> list[LayerSource]:
    """The layers as a list; TypeError / ValueError naming what is wrong and the fix."""
    one = isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList))
    if one or isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(
            f"layers must be an nn.Sequential or a list of modules or of layer factories, "
            f"got {'one ' if one else ''}{type(layers).__name__}; fix: "
            "profile_model(nn.Sequential(...), sample)"
        )
    items = list(layers)
    if not items:
        raise ValueError(
            "layers is empty: nothing to profile; fix: pass the model's layers, e.g. "
            "profile_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8))"
        )
    bad = [f"layers[{i}] is a {type(x).__name__}" for i, x in enumerate(items)
           if not (isinstance(x, nn.Module) or callable(x))]
    if bad:
        raise TypeError(f"{', '.join(bad)}: every layer must be an nn.Module or a "
                        "factory that returns one (e.g. functools.partial(nn.Linear, 8, 8))")
    return items


def build_layer(index: int, source: LayerSource, *, device: torch.device,
                dtype: torch.dtype | None = None) -> nn.Module:
    """Layer ``index`` on ``device`` (in ``dtype``), in training mode: a deep copy of a
    module (the caller's is left untouched), or what a factory returns.

    Example:
        >>> layer = nn.Linear(2, 2).eval()
        >>> copy_ = build_layer(0, layer, device=torch.device("cpu"))
        >>> copy_ is layer, copy_.training, layer.training
        (False, True, False)
    """
    if isinstance(source, nn.Module):
        layer = copy.deepcopy(source)
    else:
        layer = source()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer factory {index} ({source!r}) returned a "
                            f"{type(layer).__name__}, not an nn.Module")
    layer.to(device=device, dtype=dtype)
    return layer.train()


def first_rows(value: Any, rows: int) -> Any:
    """``value`` with every tensor of at least one dimension cut to its first ``rows``.

    Example:
        >>> first_rows({"x": torch.zeros(4, 2), "scale": torch.tensor(2.0)}, 1)["x"].shape
        torch.Size([1, 2])
    """
    return map_tensors(lambda t: t[:rows] if t.dim() > 0 else t, value)


def default_device() -> torch.device:
    """CUDA (the current device) if available, else the CPU.

    Example:
        >>> default_device().type in ("cpu", "cuda")
        True
    """
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def measuring(device: torch.device) -> Iterator[None]:
    """What every measurement runs in: gradients enabled, and the caller's random state
    (of the CPU and of ``device``) restored afterwards.

    Example:
        >>> state = torch.random.get_rng_state()
        >>> with measuring(torch.device("cpu")):
        ...     _ = torch.randn(3)
        >>> torch.equal(state, torch.random.get_rng_state())
        True
    """
    forked = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.enable_grad(), torch.random.fork_rng(devices=forked):
        yield


def is_whole(value: object) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_settings(rows: int, batch_size: int | None, microbatch_size: int | None,
                   warmup: int,
                   repetitions: int, optimizer: object, loss_fn: object,
                   target: object) -> None:
    """Every problem with :func:`~pipetrain.plan.profiler.profile_model`'s settings, at
    once, as one ValueError."""
    problems = []
    if not (is_whole(warmup) and warmup >= 0):
        problems.append(f"warmup={warmup!r} must be an int >= 0, e.g. warmup=2")
    if not (is_whole(repetitions) and repetitions >= 1):
        problems.append(f"repetitions={repetitions!r} must be an int >= 1, e.g. repetitions=5")
    if not (callable(optimizer) or optimizer in OPTIMIZERS):
        problems.append(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)} nor a "
                        "callable params -> torch.optim.Optimizer")
    if batch_size is not None and not (is_whole(batch_size) and 1 <= batch_size <= rows):
        problems.append(f"batch_size={batch_size!r} must be an int in 1..{rows} (the sample's "
                        f"rows); fix: leave it out to profile all {rows}")
    size = batch_size if batch_size is not None and is_whole(batch_size) else rows
    if microbatch_size is not None and not (is_whole(microbatch_size)
                                            and 1 <= microbatch_size <= size):
        problems.append(f"microbatch_size={microbatch_size!r} must be an int in 1..{size}, "
                        f"e.g. microbatch_size={max(1, size // 4)}")
    if loss_fn is not None and not callable(loss_fn):
        problems.append(f"loss_fn={loss_fn!r} must be callable as loss_fn(output, target)")
    if loss_fn is None and target is not None:
        problems.append("a target is given without loss_fn; fix: pass loss_fn too, "
                        "or leave target out")
    if problems:
        raise ValueError("cannot profile: " + "; ".join(problems))
