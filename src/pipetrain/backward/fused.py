"""The whole backward of a stage in one autograd pass, linear layers' weight gradients fused.

One ``torch.autograd.backward`` from the stage's roots (:mod:`.roots`: implicit
gradients, no output data kept) to the received inputs that need a gradient, the
parameters autograd handles, and the output of every fusible linear layer
(:mod:`.split`). Autograd computes the activation gradients and accumulates the other
parameters' gradients as usual; a pre-hook on each fusible layer's node accumulates its
weight gradient the moment the layer's output gradient arrives, ``W.grad.addmm_(g.T, x)``
(one GEMM, no fresh gradient to add: gradient-accumulation fusion), after which the
gradient and the layer's input are freed, as autograd frees them. Nothing is held for
a second pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.backward.roots import Root, start_points
from pipetrain.backward.split import _as_linear, _Linear, _walk

__all__ = ["fused_backward"]


def _eager(linear: _Linear, pool: GradientPool | None) -> Any:
    """A pre-hook that accumulates ``linear``'s weight gradient from its output gradient."""

    def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
        linear.grad = grads[0]
        linear.run(pool)  # frees the saved input (``linear.x``) and the gradient

    return hook


def fused_backward(
    outputs: Sequence[Root],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    pool: GradientPool | None = None,
) -> list[torch.Tensor | None]:
    """A whole backward with gradient-accumulation fusion for the linear layers.

    ``outputs[k]`` (a tensor or a :class:`~.roots.Seed`) receives ``grad_outputs[k]``
    (``None`` for a scalar loss). Weight gradients accumulate into ``.grad`` as with
    ``torch.autograd.backward``; the gradients of ``inputs`` are returned (``None`` where
    an input needs none), and their ``.grad`` is left as it was. ``pool`` lends the
    linear layers gradient buffers kept from an earlier step.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> (gx,) = fused_backward([lin(x)], [torch.ones(2, 3)], [x], list(lin.parameters()))
        >>> torch.allclose(lin.bias.grad, torch.full((3,), 2.0)), x.grad is None
        (True, True)
    """
    starts = start_points(outputs, grad_outputs)
    inputs = list(inputs)
    needed = [x for x in inputs if x.requires_grad]
    if not starts:
        return [None] * len(inputs)
    params = [p for p in params if p.requires_grad]
    param_ids = {id(p) for p in params}
    order, consumers = _walk([s.grad_fn for s in starts])
    linears = [lin for lin in (_as_linear(node, consumers, param_ids) for node in order)
               if lin is not None]
    fused = {id(lin.weight) for lin in linears} | {id(lin.bias) for lin in linears
                                                   if lin.bias is not None}
    others = [p for p in params if id(p) not in fused]
    kept = [x.grad for x in needed]  # the inputs' own .grad, put back below
    for x in needed:
        x.grad = None
    handles = [lin.node.register_prehook(_eager(lin, pool)) for lin in linears]
    try:
        targets: list[Any] = [*needed, *others, *(GradientEdge(lin.node, 0) for lin in linears)]
        torch.autograd.backward(starts, inputs=targets)
        grads = {id(x): x.grad for x in needed}
    finally:
        for handle in handles:
            handle.remove()
        for x, grad in zip(needed, kept):
            x.grad = grad
    return [grads.get(id(x)) for x in inputs]
