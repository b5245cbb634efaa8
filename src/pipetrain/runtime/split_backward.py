"""Backward split in two: gradients for the inputs now (I), for the weights later (W).

Zero-bubble schedules run a micro-batch's input-gradient pass as soon as the next stage
needs it and defer the weight-gradient pass to fill bubbles. This works for any module:

1. Walk the autograd graph from the outputs and mark the nodes that lead to an input.
2. A node on an input path with an edge into a parameter-only subgraph is a *boundary*:
   a pre-hook records the gradients that reach it during the input pass.
3. The input pass is ``torch.autograd.grad(outputs, inputs, retain_graph=True)``: autograd
   computes only what the inputs need, so no weight gradient is computed.
4. The weight pass restarts autograd at the boundaries (``GradientEdge``) with the
   recorded gradients and accumulates into ``param.grad``.

Nothing is computed twice except the boundary nodes themselves, which now compute only
their weight side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGradient", "backward_input"]


@dataclass
class _Group:
    """One restart point of the weight pass: autograd edges, their gradients, their weights."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]


@dataclass
class WeightGradient:
    """The deferred weight-gradient pass of one micro-batch (see :func:`backward_input`)."""

    groups: list[_Group] = field(default_factory=list)

    def run(self) -> None:
        """Accumulate the weight gradients into ``param.grad`` and free the graph."""
        for group in self.groups:
            grads = torch.autograd.grad(
                group.edges, group.params, grad_outputs=group.grads, allow_unused=True
            )
            for param, grad in zip(group.params, grads):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad
        self.groups.clear()


def _children(node: Any) -> list[Any]:
    return [child for child, _ in node.next_functions if child is not None]


def _params_below(node: Any, param_of: dict[Any, torch.Tensor]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in param_of:
            found[id(param_of[current])] = param_of[current]
        stack.extend(_children(current))
    return list(found.values())


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """Gradients of ``inputs`` now, and the weight-gradient pass to run later.

    ``outputs[k]`` receives gradient ``grad_outputs[k]`` (``None`` for a scalar loss).

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> (gx,), later = backward_input([lin(x).sum()], [None], [x], list(lin.parameters()))
        >>> lin.weight.grad is None
        True
        >>> later.run()
        >>> lin.weight.grad.shape
        torch.Size([3, 3])
    """
    params = [p for p in params if p.requires_grad]
    weight = WeightGradient()
    inputs = list(inputs)
    pairs = [(t, g) for t, g in zip(outputs, grad_outputs) if t.requires_grad]
    needed = [x for x in inputs if x.requires_grad]
    if not pairs:
        return [None] * len(inputs), weight
    input_nodes = {get_gradient_edge(x).node for x in needed}
    param_of = {get_gradient_edge(p).node: p for p in params}

    # reaches[node] = (leads to an input, leads to a parameter), by iterative post-order
    reaches: dict[Any, tuple[bool, bool]] = {}
    roots = [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node for t, _ in pairs]
    stack: list[tuple[Any, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in reaches:
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if c not in reaches)
            continue
        to_input = node in input_nodes
        to_param = node in param_of
        for child in _children(node):
            child_input, child_param = reaches[child]
            to_input = to_input or child_input
            to_param = to_param or child_param
        reaches[node] = (to_input, to_param)

    # boundaries: nodes on an input path with a child that leads only to parameters
    boundaries = [
        node
        for node, (to_input, _) in reaches.items()
        if to_input and any(not reaches[c][0] and reaches[c][1] for c in _children(node))
    ]
    groups: dict[Any, list[torch.Tensor]] = {}
    for node in boundaries:
        below: dict[int, torch.Tensor] = {}
        for child in _children(node):
            if not reaches[child][0] and reaches[child][1]:
                below.update((id(p), p) for p in _params_below(child, param_of))
        groups[node] = list(below.values())
    # outputs that do not lead to an input go to the weight pass whole
    input_pairs = []
    whole: list[tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]] = []
    for (tensor, grad), root in zip(pairs, roots):
        to_input, to_param = reaches[root]
        if to_input:
            input_pairs.append((tensor, grad))
        elif to_param:
            whole.append((tensor, grad, _params_below(root, param_of)))
    # a weight reached from two restart points would be counted twice: do it all now
    seen_params: set[int] = set()
    shared = False
    for group_params in [*groups.values(), *(w[2] for w in whole)]:
        ids = {id(p) for p in group_params}
        shared = shared or bool(ids & seen_params)
        seen_params |= ids
    if shared or not needed:
        torch.autograd.backward(
            [t for t, _ in pairs], [g for _, g in pairs], inputs=[*needed, *params] or None
        )
        return [x.grad if x.requires_grad else None for x in inputs], weight

    captured: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in boundaries:
        def hook(grads: tuple[torch.Tensor | None, ...], node: Any = node) -> None:
            captured[node] = grads
        handles.append(node.register_prehook(hook))
    input_grads: dict[int, torch.Tensor | None] = {}
    try:
        if input_pairs:
            grads = torch.autograd.grad(
                [t for t, _ in input_pairs],
                needed,
                grad_outputs=[g for _, g in input_pairs],
                retain_graph=True,
                allow_unused=True,
            )
            input_grads = {id(x): g for x, g in zip(needed, grads)}
    finally:
        for handle in handles:
            handle.remove()
    for node in boundaries:
        edges, edge_grads = [], []
        for index, grad in enumerate(captured.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                edge_grads.append(grad)
        if edges:
            weight.groups.append(_Group(edges, edge_grads, groups[node]))
    for tensor, grad, group_params in whole:
        weight.groups.append(
            _Group([get_gradient_edge(tensor)], [grad if grad is not None else torch.ones_like(tensor)], group_params)
        )
    return [input_grads.get(id(x)) for x in inputs], weight
