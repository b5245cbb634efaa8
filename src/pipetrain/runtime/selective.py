"""Selective recomputation: keep the outputs of a stage's matrix products, recompute the rest.

Full re-materialization (``checkpoint="always"``) keeps only a stage's input and runs its
whole forward again before the backward. Most of a transformer block's saved bytes,
though, come from cheap element-wise ops (normalizations, activations, dropout masks,
residual sums), while most of its time goes to matrix products and attention. The
*selective* mode keeps what is expensive to recompute (the outputs of ``mm``, ``addmm``,
``bmm``, ``baddbmm``, attention kernels and convolutions) and drops the rest, which the
backward recomputes from the kept tensors (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models", as Megatron-LM's
``--recompute-granularity selective``).

It is torch's own selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``, non-reentrant
checkpoint with a per-op policy); this module only names the ops that are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["KEPT_OPS", "keep_expensive", "selective_call"]

T = TypeVar("T")


def _ops(*names: str) -> frozenset[Any]:
    """The aten overload packets of ``names`` that this torch has."""
    return frozenset(getattr(torch.ops.aten, name) for name in names
                     if hasattr(torch.ops.aten, name))


KEPT_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm",
)
"""The ops whose outputs the selective mode keeps (their overload packets)."""


def keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep the outputs of :data:`KEPT_OPS`, recompute the rest.

    Example:
        >>> keep_expensive(None, torch.ops.aten.mm.default).name
        'MUST_SAVE'
        >>> keep_expensive(None, torch.ops.aten.gelu.default).name
        'PREFER_RECOMPUTE'
    """
    packet = getattr(op, "overloadpacket", op)
    if packet in KEPT_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_call(function: Callable[..., T], *args: Any, preserve_rng_state: bool = True) -> T:
    """``function(*args)`` with its element-wise ops' saved tensors dropped and recomputed
    in backward (see the module's docstring); the random generators' states are restored
    for the recomputation, so dropout draws the same masks (``preserve_rng_state=False``:
    left alone, for a function that seeds its own random streams).

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> selective_call(layer, x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    return checkpoint(  # type: ignore[no-any-return]
        function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
        context_fn=functools.partial(create_selective_checkpoint_contexts, keep_expensive),
    )
