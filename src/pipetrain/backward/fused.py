"""A full backward in one autograd pass, with linear layers' weight gradients fused.

:func:`fused_backward` walks the autograd graph of the outputs once to find the fusible
linear layers (:mod:`.split`), then runs ONE ``torch.autograd.backward`` whose inputs
are the received tensors that need a gradient, every parameter left to autograd, and the
output edge of every fusible linear layer. A pre-hook on each such layer's node receives
the gradient of its output as the node is about to run, and accumulates the weight
gradient in place right then, while that gradient is still in the cache; autograd itself
computes only the layer's input gradient (the weight is no input of the pass). No graph
is retained and nothing is walked twice. (A stage whose parameters all belong to fused
layers with small output gradients, an MLP on few rows, takes them from the pass's
result instead: a Python hook inside autograd costs about 40 us.)

Only weights of at least :data:`~pipetrain.backward.split.FUSE_MIN_ELEMENTS` elements
are fused: for a small weight the Python hook costs more than autograd's accumulation.
With nothing to fuse (no such weight among the parameters: nothing is walked; no linear
layer; autocast, whose casts put the weights out of reach) it is autograd's backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.backward.roots import Root, start_points
from pipetrain.backward.split import FUSE_MIN_ELEMENTS, _Linear, _linears, _walk

__all__ = ["CAPTURE_BYTES", "fused_backward"]

CAPTURE_BYTES = 1 << 20
"""When every parameter belongs to a fused layer and their output gradients add up to at
most this, they are returned by the pass and accumulated after it instead of by hooks."""


def fused_backward(
    outputs: Sequence[Root],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    pool: GradientPool | None = None,
    min_elements: int = FUSE_MIN_ELEMENTS,
) -> list[torch.Tensor | None]:
    """A full backward with gradient-accumulation fusion for the linear layers.

    ``outputs[k]`` (a tensor or a :class:`~.roots.Seed`) receives gradient
    ``grad_outputs[k]`` (``None`` for a scalar loss).
    The gradients of ``inputs`` are returned (the ones that require grad; ``None`` for
    the others), not stored in their ``.grad``; weight gradients accumulate into
    ``.grad`` as with ``torch.autograd.backward``. ``pool`` lends the fused layers gradient buffers kept
    from the last step; weights with fewer than ``min_elements`` elements are left to
    autograd.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> (gx,) = fused_backward([lin(x)], [torch.ones(2, 3)], [x], list(lin.parameters()),
        ...                        min_elements=0)
        >>> torch.allclose(lin.bias.grad, torch.full((3,), 2.0))
        True
    """
    params = [p for p in params if p.requires_grad]
    inputs = list(inputs)
    # scalars that start the backward with implicit gradients (see .roots)
    tensors = start_points(outputs, grad_outputs)
    needed = [x for x in inputs if x.requires_grad]
    if not tensors:
        return [None] * len(inputs)
    linears: dict[Any, _Linear] = {}
    if any(p.dim() == 2 and p.numel() >= min_elements for p in params):
        roots = [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
                 for t in tensors]
        order, consumers = _walk(roots)
        linears = _linears(order, consumers, params, min_elements=min_elements)
    if linears and _captured_bytes(linears) <= CAPTURE_BYTES:
        fused = {id(p) for linear in linears.values() for p in linear.params}
        if all(id(p) in fused for p in params):
            return _capturing(tensors, inputs, needed, linears, pool)
    kept = [x.grad for x in needed]  # the inputs' own .grad is left as it was
    for x in needed:
        x.grad = None
    try:
        if not linears:
            torch.autograd.backward(tensors, inputs=[*needed, *params] or None)
        else:
            fused = {id(p) for linear in linears.values() for p in linear.params}
            rest = [p for p in params if id(p) not in fused]
            # the linear nodes are inputs of the pass, so each runs (and its hook fires)
            # even when nothing below it needs a gradient; their weights are not, so
            # autograd leaves them to the hooks
            edges: list[Any] = [GradientEdge(node, 0) for node in linears]
            handles = [node.register_prehook(_hook(linear, pool)) for node, linear in linears.items()]
            try:
                torch.autograd.backward(tensors, inputs=[*needed, *rest, *edges])
            finally:
                for handle in handles:
                    handle.remove()
        found = {id(x): x.grad for x in needed}
    finally:
        for x, grad in zip(needed, kept):
            x.grad = grad
    return [found.get(id(x)) for x in inputs]


def _captured_bytes(linears: dict[Any, _Linear]) -> int:
    """Bytes of the layers' output gradients, were they all held at once."""
    total = 0
    for linear in linears.values():
        if linear.x is not None:
            out = linear.weight.shape[0 if linear.transposed else 1]
            total += linear.x.shape[0] * out * linear.x.element_size()
    return total


def _capturing(tensors: list[torch.Tensor], inputs: list[torch.Tensor], needed: list[torch.Tensor],
               linears: dict[Any, _Linear], pool: GradientPool | None) -> list[torch.Tensor | None]:
    """Every parameter is a fused layer's and their output gradients are small: one
    ``autograd.grad`` returns those gradients with the inputs', and the weight gradients
    are accumulated after it (no Python call inside autograd, ~40 us per layer saved)."""
    edges: list[Any] = [GradientEdge(node, 0) for node in linears]
    found = torch.autograd.grad(tensors, [*needed, *edges], allow_unused=True)
    for linear, grad in zip(linears.values(), found[len(needed):]):
        linear.grad = grad
        linear.run(pool)
    by_input = {id(x): g for x, g in zip(needed, found)}
    return [by_input.get(id(x)) for x in inputs]


def _hook(linear: _Linear, pool: GradientPool | None) -> Any:
    """A pre-hook that accumulates ``linear``'s weight gradient from its output gradient."""

    def accumulate(grads: tuple[torch.Tensor | None, ...]) -> None:
        linear.grad = grads[0]
        linear.run(pool)  # frees the saved input (``linear.x``) and the gradient

    return accumulate
