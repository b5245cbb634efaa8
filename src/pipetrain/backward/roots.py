"""Backward roots: where a stage's backward starts, without keeping its outputs' data.

A stage's backward starts from its outputs with the gradients the next stage sent. Handing
``torch.autograd`` an output and an explicit gradient has two costs: the output's data
must be kept until then (although its graph rarely needs it), and torch checks the
gradient's shape with its symbolic-shapes module, whose first use imports sympy (about
35 MiB of resident memory in every process that trains with the pipeline). A
:class:`Seed` avoids both: taken when the output is made, it is a scalar whose backward
hands the output the gradient given later (:meth:`Seed.feed`), so a backward starts from
scalars with implicit gradients, and only the output's graph is kept. Autograd still
checks the gradient against the output's shape, dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Root", "Seed", "backward_root", "start_points"]


class _SeedFunction(torch.autograd.Function):
    """A scalar (zero) computed from a tensor; its backward returns the boxed gradient."""

    @staticmethod
    def forward(ctx: Any, box: list[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        ctx.box = box  # not the output: its data may be freed
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        return None, (ctx.box[0] if ctx.box else None)


class Seed:
    """A backward root standing for an output tensor (see the module's docstring).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> seed = Seed(x * 3)          # the product's data can be freed now
        >>> torch.autograd.grad([seed.feed(torch.ones(2))], [x])
        (tensor([3., 3.]),)
    """

    def __init__(self, output: torch.Tensor) -> None:
        if not output.requires_grad:
            raise ValueError("a backward root needs an output that requires grad; got one "
                             "that does not (fix: take roots only of such outputs)")
        self._box: list[torch.Tensor] = []
        self.tensor: torch.Tensor = _SeedFunction.apply(self._box, output)  # type: ignore[no-untyped-call]
        """the scalar to start the backward from (with an implicit gradient)"""

    def feed(self, grad: torch.Tensor) -> torch.Tensor:
        """Give the output's gradient; returns :attr:`tensor`, the backward's start."""
        self._box[:] = [grad]
        return self.tensor


Root = torch.Tensor | Seed
"""Where a backward starts: an output tensor (a loss, or one given with its gradient), or
a :class:`Seed` taken of an output."""


def backward_root(output: torch.Tensor) -> Seed:
    """The root a later backward from ``output`` starts at (``output`` requires grad);
    unlike ``output`` itself it does not keep the output's data.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> root = backward_root(x * 3)
        >>> torch.autograd.backward(start_points([root], [torch.ones(2)]))
        >>> x.grad
        tensor([3., 3.])
    """
    return Seed(output)


def start_points(roots: Sequence[Root], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """Tensors to start a backward from with implicit gradients (``grad_tensors=None``)
    that give ``roots[k]`` the gradient ``grads[k]``: a :class:`Seed` is fed its gradient,
    an output given with a gradient gets a seed now, and a scalar given with ``None``
    (a loss) starts the backward itself. Roots that need no gradient are left out.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> starts = start_points([x * 2, (x * 5).sum()], [torch.ones(2), None])
        >>> torch.autograd.backward(starts)
        >>> x.grad
        tensor([7., 7.])
    """
    starts = []
    for root, grad in zip(roots, grads):
        if isinstance(root, Seed):
            if grad is not None:
                starts.append(root.feed(grad))
        elif root.requires_grad:
            starts.append(root if grad is None else Seed(root).feed(grad))
    return starts
