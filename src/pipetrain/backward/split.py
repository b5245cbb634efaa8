"""Backward split in two: gradients for the inputs now (I), for the weights later (W).

Zero-bubble schedules run a micro-batch's input-gradient pass as soon as the next stage
needs it and defer the weight-gradient pass to fill bubbles. This works for any module:

1. Walk the autograd graph from the outputs. *Anchors* are the received inputs that need
   a gradient and every fusible linear layer (below). A node on a path to an anchor with
   an edge into a parameter-only subgraph is a *boundary*.
2. The input pass is one ``torch.autograd.grad`` to the inputs and to the output of every
   fusible linear layer: autograd computes the activation gradients only. Pre-hooks
   record what reaches the other boundaries.
3. The weight pass accumulates each linear layer's weight gradient in place,
   ``W.grad.addmm_(g.T, x)`` (one GEMM that reads and writes ``W.grad`` once, instead of
   a fresh gradient plus an addition: gradient-accumulation fusion), and restarts
   autograd at the other boundaries (``GradientEdge``) for the remaining weights. When
   those remaining weights are few (at most :data:`EAGER_SHARE` of the elements: a
   transformer's norms, biases and embeddings), the input pass computes their gradients
   too and the graph is freed right after it: between ``I`` and ``W`` a micro-batch then
   keeps only its linear layers' inputs and output gradients.

A linear layer is *fusible* when its node is ``addmm`` / ``mm`` of a saved 2-D input
``x`` and a 2-D weight that is a parameter of the stage, either transposed (``x @ W.T``:
``nn.Linear``, ``F.linear``; a 3-D input is flattened into such a node) or not
(``x @ W``: Hugging Face's ``Conv1D``), the weight (and bias) feed no other node, and
they carry no Python hooks. Under autocast the weight reaches the GEMM through a cast,
so nothing fuses there. Everything else takes autograd's path. A full backward (no
split) runs in one pass instead: :mod:`.fused`.

Reading a node as a GEMM and a parameter's hooks needs private torch names: that is
:mod:`pipetrain.compat`'s (:func:`~pipetrain.compat.gemm_node`), which turns fusion off
on a torch where they do not behave as expected. Parameters are matched to the graph
through the public ``torch.autograd.graph.get_gradient_edge``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.backward.roots import Root, start_points
from pipetrain.compat import gemm_node, has_grad_hooks, transposed_input

__all__ = ["EAGER_SHARE", "FUSE_MIN_ELEMENTS", "GradientPool", "WeightGradient",
           "backward_input"]

EAGER_SHARE = 0.1
"""When the weights that are not fused linear layers' hold at most this share of a stage's
parameter elements (norms, biases, embeddings of a transformer), the input pass computes
their gradients too and frees the graph: the weight pass then keeps only the linear
layers' inputs and output gradients, not every saved activation."""

FUSE_MIN_ELEMENTS = 1 << 18
"""Weights smaller than this (1 MiB in fp32) are left to autograd in a full backward
(:mod:`.fused`): accumulating a small weight's gradient costs autograd little (its
transposed addition stays in cache), less than the Python call that would fuse it."""


@dataclass
class _Group:
    """One restart point of the weight pass: autograd edges, their gradients, their weights."""

    edges: list[GradientEdge] | list[torch.Tensor]
    grads: list[torch.Tensor | None]
    """``None`` for a scalar that starts a backward (:func:`~.roots.start_points`)"""
    params: list[torch.Tensor]


@dataclass
class _Linear:
    """A fusible linear layer: ``y = x @ weight.T (+ bias)`` (``transposed``) or
    ``y = x @ weight (+ bias)``, and the gradient of ``y``."""

    node: Any
    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor | None
    """the saved input (``None`` once accumulated: the layer's input may be freed then)"""
    transposed: bool = True
    x_edge: int = 1
    """the index of the node's edge that ``x``'s gradient leaves by"""
    grad: torch.Tensor | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def run(self, pool: GradientPool | None) -> None:
        with torch.no_grad():  # the saved input requires grad; the accumulation must not
            self._accumulate(pool)
        self.x = None

    def _accumulate(self, pool: GradientPool | None) -> None:
        g, x = self.grad, self.x
        if g is None or x is None:
            return
        a, b = (g.t(), x) if self.transposed else (x.t(), g)
        if self.weight.grad is None:
            buffer = pool.take(self.weight) if pool is not None else None
            self.weight.grad = a.mm(b) if buffer is None else torch.mm(a, b, out=buffer)
            if pool is not None:
                pool.lend(self.weight, self.weight.grad)
        else:
            self.weight.grad.addmm_(a, b)
        if self.bias is not None:
            if self.bias.grad is None:
                self.bias.grad = g.sum(0)
            else:
                self.bias.grad.add_(g.sum(0))
        self.grad = None


def _accumulate(params: Sequence[torch.Tensor], grads: Iterable[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


@dataclass
class WeightGradient:
    """The deferred weight-gradient pass of one micro-batch (see :func:`backward_input`)."""

    groups: list[_Group] = field(default_factory=list)
    linears: list[_Linear] = field(default_factory=list)
    pool: GradientPool | None = None

    def run(self) -> None:
        """Accumulate the weight gradients into ``param.grad`` and free the graph."""
        while self.linears:  # each layer's input and gradient are freed once used
            self.linears.pop(0).run(self.pool)
        for group in self.groups:
            grads = torch.autograd.grad(
                group.edges, group.params, grad_outputs=group.grads, allow_unused=True
            )
            _accumulate(group.params, grads)
        self.linears.clear()
        self.groups.clear()


def _children(node: Any) -> list[Any]:
    return [child for child, _ in node.next_functions if child is not None]


def _own_param(node: Any, consumers: dict[Any, int],
               param_of: dict[Any, torch.Tensor]) -> torch.Tensor | None:
    """The parameter accumulated by ``node`` if it is one of ``param_of``'s, used only
    there and without hooks."""
    param = param_of.get(node) if node is not None else None
    if param is None or consumers.get(node) != 1 or has_grad_hooks(param):
        return None
    return param


def _as_linear(node: Any, consumers: dict[Any, int],
               param_of: dict[Any, torch.Tensor]) -> _Linear | None:
    gemm = gemm_node(node)
    if gemm is None:
        return None
    w_node, x = gemm.weight, gemm.x
    below = transposed_input(w_node)
    transposed = below is not None
    if transposed:
        if consumers.get(w_node) != 1:
            return None
        w_node = below
    weight = _own_param(w_node, consumers, param_of)
    if weight is None or weight.dim() != 2 or x is None or x.dim() != 2 or x.dtype != weight.dtype:
        return None
    bias = None
    if gemm.bias is not None:
        bias = _own_param(gemm.bias, consumers, param_of)
        if bias is None or bias.dim() != 1:
            return None
    return _Linear(node, weight, bias, x, transposed, gemm.x_edge)


def _linears(order: Sequence[Any], consumers: dict[Any, int], params: Iterable[torch.Tensor],
             *, min_elements: int = 0) -> dict[Any, _Linear]:
    """The fusible linear layers among ``order`` whose weights have at least
    ``min_elements`` elements, by node."""
    # only matrices (weights) and vectors (biases) can be a linear layer's
    param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad and (
        p.dim() == 1 or (p.dim() == 2 and p.numel() >= min_elements))}
    found: dict[Any, _Linear] = {}
    if not param_of:
        return found
    for node in order:
        linear = _as_linear(node, consumers, param_of)
        if linear is not None:
            found[node] = linear
    return found


def _walk(roots: list[Any]) -> tuple[list[Any], dict[Any, int]]:
    """Every node under ``roots`` (children before parents) and its number of consumers."""
    order: list[Any] = []
    consumers: dict[Any, int] = {}
    seen: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child in _children(node):
            consumers[child] = consumers.get(child, 0) + 1
            if child not in seen:
                stack.append((child, False))
    return order, consumers


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
    outputs: Sequence[Root],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    fuse: bool = True,
    pool: GradientPool | None = None,
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """Gradients of ``inputs`` now, and the weight-gradient pass to run later.

    ``outputs[k]`` (a tensor or a :class:`~.roots.Seed`) receives gradient
    ``grad_outputs[k]`` (``None`` for a scalar loss). ``fuse=False`` leaves linear layers
    to autograd too; ``pool`` lends them gradient buffers kept from the last step. For a
    whole backward, see :func:`~.fused.fused_backward`.

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
    weight = WeightGradient(pool=pool)
    inputs = list(inputs)
    # scalars that start the backward with implicit gradients (see .roots)
    pairs: list[tuple[torch.Tensor, None]] = [
        (t, None) for t in start_points(outputs, grad_outputs)
    ]
    needed = [x for x in inputs if x.requires_grad]
    if not pairs:
        return [None] * len(inputs), weight
    roots = [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node for t, _ in pairs]
    order, consumers = _walk(roots)
    param_of = {get_gradient_edge(p).node: p for p in params}
    linears = _linears(order, consumers, params) if fuse else {}
    input_nodes = {get_gradient_edge(x).node for x in needed}

    def followed(node: Any) -> list[Any]:
        if node in linears:  # its weight and bias are the fused pass's
            x_node = node.next_functions[linears[node].x_edge][0]
            return [x_node] if x_node is not None else []
        return _children(node)

    # reaches[node] = (leads to an anchor, leads to a parameter left to autograd)
    reaches: dict[Any, tuple[bool, bool]] = {}
    for node in order:  # children first
        to_anchor = node in input_nodes or node in linears
        to_param = node in param_of and node not in linears
        for child in followed(node):
            child_anchor, child_param = reaches.get(child, (False, False))
            to_anchor = to_anchor or child_anchor
            to_param = to_param or child_param
        reaches[node] = (to_anchor, to_param)

    boundaries = [
        node for node in order
        if reaches[node][0]
        and any(not reaches[c][0] and reaches[c][1] for c in followed(node))
    ]
    groups: dict[Any, list[torch.Tensor]] = {}
    for node in boundaries:
        below: dict[int, torch.Tensor] = {}
        for child in followed(node):
            if not reaches[child][0] and reaches[child][1]:
                below.update((id(p), p) for p in _params_below(child, param_of))
        groups[node] = list(below.values())
    anchored, whole = [], []
    for (tensor, grad), root in zip(pairs, roots):
        to_anchor, to_param = reaches[root]
        if to_anchor:
            anchored.append((tensor, grad))
        elif to_param:
            whole.append((tensor, grad, _params_below(root, param_of)))
    # a weight reached from two restart points would be counted twice: do it all now
    seen_params: set[int] = set()
    shared = False
    for group_params in [*groups.values(), *(w[2] for w in whole)]:
        ids = {id(p) for p in group_params}
        shared = shared or bool(ids & seen_params)
        seen_params |= ids
    if shared or (not linears and not needed):
        torch.autograd.backward(
            [t for t, _ in pairs], [g for _, g in pairs], inputs=[*needed, *params] or None
        )
        return [x.grad if x.requires_grad else None for x in inputs], weight

    fused_ids = {id(q) for lin in linears.values() for q in lin.params}
    others = [q for q in params if id(q) not in fused_ids]
    if (groups or whole) and linears and sum(q.numel() for q in others) <= EAGER_SHARE * sum(
            q.numel() for q in params):
        # the other weights' gradients now, so that the graph is freed: the weight pass
        # keeps only the linear layers' inputs and output gradients
        return _input_and_small_weights(pairs, needed, inputs, list(linears.values()), others,
                                        weight)
    captured: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in boundaries:
        if node in linears:
            continue  # its incoming gradient is returned by the input pass
        def hook(grads: tuple[torch.Tensor | None, ...], node: Any = node) -> None:
            captured[node] = grads
        handles.append(node.register_prehook(hook))
    linear_list = list(linears.values())
    targets: list[Any] = [*needed, *(GradientEdge(lin.node, 0) for lin in linear_list)]
    input_grads: dict[int, torch.Tensor | None] = {}
    try:
        if anchored and targets:
            grads = torch.autograd.grad(
                [t for t, _ in anchored],
                targets,
                grad_outputs=[g for _, g in anchored],
                retain_graph=bool(groups or whole),
                allow_unused=True,
            )
            input_grads = {id(x): g for x, g in zip(needed, grads)}
            for linear, grad in zip(linear_list, grads[len(needed):]):
                linear.grad = grad
                if linear.node in groups:
                    captured[linear.node] = (grad,)
    finally:
        for handle in handles:
            handle.remove()
    weight.linears = [lin for lin in linear_list if lin.grad is not None]
    for node in boundaries:
        edges: list[GradientEdge] = []
        edge_grads: list[torch.Tensor | None] = []
        for index, grad in enumerate(captured.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                edge_grads.append(grad)
        if edges:
            weight.groups.append(_Group(edges, edge_grads, groups[node]))
    for tensor, grad, group_params in whole:
        weight.groups.append(_Group([tensor], [grad], group_params))
    return [input_grads.get(id(x)) for x in inputs], weight


def _input_and_small_weights(
    pairs: list[tuple[torch.Tensor, None]], needed: list[torch.Tensor],
    inputs: list[torch.Tensor], linear_list: list[_Linear], others: list[torch.Tensor],
    weight: WeightGradient,
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """One pass for the inputs' gradients, the fused linear layers' output gradients and
    the other (few) weights' gradients, the graph freed after it; the weight pass is the
    linear layers' alone."""
    targets: list[Any] = [*needed, *(GradientEdge(lin.node, 0) for lin in linear_list), *others]
    grads = torch.autograd.grad([t for t, _ in pairs], targets,
                                grad_outputs=[g for _, g in pairs], allow_unused=True)
    input_grads = {id(x): g for x, g in zip(needed, grads)}
    for linear, grad in zip(linear_list, grads[len(needed):len(needed) + len(linear_list)]):
        linear.grad = grad
    _accumulate(others, grads[len(needed) + len(linear_list):])
    weight.linears = [lin for lin in linear_list if lin.grad is not None]
    return [input_grads.get(id(x)) for x in inputs], weight
