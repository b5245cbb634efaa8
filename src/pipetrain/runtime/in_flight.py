"""What a pipeline stage keeps of a micro-batch between its forward and its backward.

A received tensor that needs a gradient enters the stage through :func:`entered`: the
layers see a tensor that shares its data, and the gradient lands on a *holder*, a leaf of
the same shape whose storage is one element (an expanded scalar). The stage keeps the
holders, not the received tensors: a layer that saves nothing of its input (a
concatenation, an addition) lets the input's data go as soon as the forward is done,
as torchgpipe's single autograd graph does, where a received leaf would be held by the
graph (its gradient accumulator keeps it) until the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.backward.roots import Root
from pipetrain.nested import map_tensors

__all__ = ["InFlight", "announce", "entered", "in_place_named"]


@dataclass
class InFlight:
    """The autograd state of one micro-batch of a stage, from its forward to its backward."""

    inputs: list[torch.Tensor]
    """received leaves that require grad, in message order"""
    outputs: list[Root | None]
    """per output tensor announced as needing a gradient (message order): where its
    backward starts (its gradient edge: the graph, not the output's data), ``None`` if it
    turned out to need none; until a checkpointed micro-batch is rebuilt, all ``None``"""
    loss: torch.Tensor | None
    replay: tuple[Any, Any, float | None] | None = None
    """(message, target, loss scale) of a checkpointed micro-batch not yet recomputed"""
    layer_inputs: tuple[list[Any], Any, float | None] | None = None
    """(every layer's input, target, loss scale) of a micro-batch of a per-layer stage"""


def announce(tensor: torch.Tensor, differentiable: bool) -> bool:
    """Whether a checkpointed output is announced as needing a gradient.

    Example:
        >>> announce(torch.ones(1), True), announce(torch.ones(1, dtype=torch.long), True)
        (True, False)
    """
    return differentiable and (tensor.is_floating_point() or tensor.is_complex())


_IN_PLACE = "of _Enter is a view and is being modified inplace"
"""Part of autograd's error when a layer changes a tensor its stage received in place (a
view: marking it changed would bump the version of every tensor sharing its data, such
as the other micro-batches of the same batch)."""


@contextlib.contextmanager
def in_place_named(stage: int) -> Iterator[None]:
    """Turns autograd's error for a layer that changes its stage's input in place into
    one that names the stage and the fix.

    Example::

        with in_place_named(stage_index):
            output = module(message)
    """
    try:
        yield
    except RuntimeError as error:
        if _IN_PLACE not in str(error):
            raise
        raise RuntimeError(
            f"a layer of stage {stage} changes the stage's input in place (e.g. "
            "ReLU(inplace=True) or x += ... right after a cut), which autograd forbids on a "
            "tensor received from another stage; fix: make that layer work out of place "
            "(inplace=False), or cut the model elsewhere") from None


class _Enter(torch.autograd.Function):
    """``x`` (detached) as the stage's layers see it; its gradient goes to ``holder``."""

    @staticmethod
    def forward(ctx: Any, holder: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.device = holder.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.device), None


def entered(message: Any, to_device: Callable[[torch.Tensor], torch.Tensor], *,
            enter: Callable[[torch.Tensor], bool] = lambda t: True
            ) -> tuple[list[torch.Tensor], Any]:
    """``(holders, message for the layers)``: each tensor of ``message`` that requires
    grad and that ``enter`` accepts replaced by one that shares its data (moved by
    ``to_device``) and sends its gradient to a holder; one ``enter`` refuses is only moved
    and stands in the list for itself (the list in message order); the other tensors are
    only moved.

    Example:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> (holder,), (y, n) = entered((x, torch.zeros(1)), lambda t: t)
        >>> (y * 2).sum().backward()
        >>> holder.grad, holder.untyped_storage().nbytes(), x.grad is None
        (tensor([[2., 2., 2.],
                [2., 2., 2.]]), 4, True)
    """
    holders: list[torch.Tensor] = []

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return to_device(tensor)
        if not enter(tensor):
            holders.append(tensor)
            return to_device(tensor)
        holder = torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
        holder.requires_grad_(True)
        holders.append(holder)
        return _Enter.apply(holder, to_device(tensor.detach()))  # type: ignore[no-untyped-call,no-any-return]

    return holders, map_tensors(one, message)
