"""Layer factories: build one layer of a model, with the same initial weights anywhere.

A model is a sequence of layers, offered as a list of :data:`LayerFactory` so that a
pipeline rank builds only the layers of its own stages. A factory returns a *new*
module with the *same* initial parameters every time it is called, in any process and
in any order: it seeds the CPU random generator from ``(seed, layer index)`` inside
:func:`torch.random.fork_rng`, so the caller's random state is left untouched. This is
what makes training independent of how the layers are split across processes.

Tied parameters (one tensor used by two layers, such as GPT's token embedding and
output projection) are described as groups of ``(layer index, parameter name)``; the
factories create every member of a group with identical values, and
:func:`tie_parameters` makes them one shared :class:`torch.nn.Parameter` when all the
layers live in one module.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

__all__ = [
    "LayerFactory",
    "Tie",
    "build_sequential",
    "count_parameters",
    "derive_seed",
    "seeded",
    "tie_parameters",
]

LayerFactory = Callable[[], nn.Module]
"""Returns a new layer with the same initial parameters on every call."""

Tie = tuple[tuple[int, str], ...]
"""A group of tied parameters: ``((layer index, parameter name within that layer), ...)``."""

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_GLOBAL_RNG_LOCK = threading.RLock()  # seeded() borrows torch's global CPU generator


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and runs).

    Unlike :func:`hash`, the result does not change between Python processes, and
    distinct ``parts`` give unrelated seeds (``(0, 10)`` and ``(1, 0)`` do not collide).

    Example:
        >>> derive_seed(0, 3) == derive_seed(0, 3)
        True
        >>> derive_seed(0, 3) == derive_seed(0, 4)
        False
    """
    text = "\x1f".join(f"{type(part).__name__}:{part}" for part in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded(build: Callable[[], ModuleT], *, seed: int, index: int) -> ModuleT:
    """Call ``build()`` with the CPU generator seeded from ``(seed, index)``.

    The caller's random state is restored afterwards. Layers are built on the CPU;
    move them to a device after building. Calls from several threads take turns (the
    generator is global), but a thread drawing random numbers while another builds a
    layer would still change that layer: build the layers before training starts.

    Example:
        >>> a = seeded(lambda: nn.Linear(4, 4), seed=0, index=2)
        >>> b = seeded(lambda: nn.Linear(4, 4), seed=0, index=2)
        >>> torch.equal(a.weight, b.weight)
        True
    """
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(seed, index))
        return build()


def build_sequential(
    factories: Sequence[LayerFactory], *, ties: Sequence[Tie] = ()
) -> nn.Sequential:
    """Call every factory in order and tie the parameters named in ``ties``.

    Example:
        >>> model = build_sequential([lambda: nn.Linear(2, 3), lambda: nn.ReLU()])
        >>> len(model)
        2
    """
    model = nn.Sequential(*(factory() for factory in factories))
    tie_parameters(model, ties)
    return model


def tie_parameters(model: nn.Sequential, ties: Sequence[Tie]) -> None:
    """Make each group in ``ties`` one shared parameter: the first member's.

    Every member must exist and have the first member's shape; the other members'
    values are discarded (the factories create them equal anyway).

    Example:
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        >>> tie_parameters(model, [((0, "weight"), (1, "weight"))])
        >>> model[0].weight is model[1].weight
        True
    """
    for group in ties:
        if len(group) < 2:
            raise ValueError(f"a tie needs at least two members, got {group!r}")
        (first_index, first_name), *others = group
        shared = _get_parameter(model, first_index, first_name)
        for index, name in others:
            parameter = _get_parameter(model, index, name)
            if parameter.shape != shared.shape:
                raise ValueError(
                    f"cannot tie {(index, name)!r} of shape {tuple(parameter.shape)} to "
                    f"{(first_index, first_name)!r} of shape {tuple(shared.shape)}: "
                    "tied parameters must have the same shape"
                )
            owner_name, _, leaf = name.rpartition(".")
            owner = model[index].get_submodule(owner_name) if owner_name else model[index]
            setattr(owner, leaf, shared)


def _get_parameter(model: nn.Sequential, index: int, name: str) -> nn.Parameter:
    if not 0 <= index < len(model):
        raise ValueError(
            f"tie names layer {index} but the model has {len(model)} layers (0..{len(model) - 1})"
        )
    try:
        return model[index].get_parameter(name)
    except AttributeError:
        names = [n for n, _ in model[index].named_parameters()]
        raise ValueError(
            f"tie names parameter {name!r} of layer {index} "
            f"({type(model[index]).__name__}), which has only {names}"
        ) from None


def count_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """The number of scalar parameters of ``module``, counting a tied parameter once.

    Example:
        >>> count_parameters(nn.Linear(3, 2))  # 3 * 2 weights + 2 biases
        8
    """
    return sum(
        parameter.numel()
        for parameter in module.parameters()
        if parameter.requires_grad or not trainable_only
    )
