"""Names: a rank's stages under the model's own parameter names, and the whole state dict.

Every unit of a captured model holds its tensors under their names in the model
(``transformer.h.0.attn.c_attn.weight``). :func:`stage_container` gathers a rank's
units into one module with exactly those names (a weight the model ties under two
names, like GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``, under both), so
its ``state_dict()`` is the stage's part of ``model.state_dict()``, checkpoints do not
depend on where the model was cut (they reshard to other stage counts), and
:func:`gather_state_dict` rebuilds the whole model's state dict on one rank.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.frontend.units import register_tensor

__all__ = ["gather_state_dict", "stage_container"]


def stage_container(units: Mapping[int, nn.Module], *, persistent: Collection[str]) -> nn.Module:
    """One module holding the parameters and buffers of ``units`` under their names in
    the model (``persistent`` names the buffers that a state dict holds).

    Example:
        >>> unit = nn.Module()
        >>> unit.add_module("lm_head", nn.Linear(2, 2, bias=False))
        >>> sorted(stage_container({3: unit}, persistent=()).state_dict())
        ['lm_head.weight']
    """
    root = nn.Module()
    seen: set[str] = set()
    for index in sorted(units):
        unit = units[index]
        tensors: list[tuple[str, torch.Tensor]] = [
            *unit.named_parameters(remove_duplicate=False),
            *unit.named_buffers(remove_duplicate=False),
        ]
        for name, tensor in tensors:
            if name in seen or name.startswith("pipetrain_"):
                continue
            seen.add(name)
            register_tensor(root, name, tensor, name in persistent)
    return root


def gather_state_dict(local: Mapping[str, torch.Tensor], *, order: Sequence[str] | None,
                      dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on rank ``dst`` (``None`` elsewhere), keys in
    ``order`` (the model's; ``None``: as gathered), from every rank's ``local`` part
    (every rank calls it).

    Raises:
        RuntimeError: some key of ``order`` is held by no rank.
    """
    mine = {k: v.detach().cpu() for k, v in local.items()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    parts: list[Any] = [mine] if world == 1 else [None] * world
    if world > 1:
        dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst)
        if dist.get_rank() != dst:
            return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, value)
    if order is None:
        return merged
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"no rank holds {missing[:5]} of the model's state dict")
    return {k: merged[k] for k in order}
