"""Linear layers found in an autograd graph, whose weight gradients pipetrain accumulates itself.

Gradient-accumulation fusion: a linear layer's weight gradient is one GEMM, and over the
micro-batches of a step autograd computes it into a fresh tensor and adds that to
``.grad`` (for ``nn.Linear``, through a transposed view). Writing the GEMM's result into
``.grad`` directly, ``W.grad.addmm_(g.T, x)``, reads and writes ``.grad`` once and needs
no temporary (with small micro-batches the backward of a linear layer is memory-bound,
and this cuts it by about 40%).

A linear layer is *fusible* when its node is ``addmm`` / ``mm`` of a saved 2-D input
``x`` and a 2-D weight that is a parameter of the stage, either transposed (``x @ W.T``:
``nn.Linear``, ``F.linear``; a 3-D input is flattened into such a node) or not
(``x @ W``: Hugging Face's ``Conv1D``), the weight (and bias) feed no other node, and
they carry no Python hooks. Under autocast the weight reaches the GEMM through a cast,
so nothing fuses there. Everything else takes autograd's path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.backward.gradient_pool import GradientPool

__all__ = ["FUSE_MIN_ELEMENTS", "Linear", "children", "find_linears", "walk"]

FUSE_MIN_ELEMENTS = 1 << 18
"""Weights smaller than this (1 MiB in fp32) are left to autograd in a full backward:
accumulating a small weight's gradient costs autograd little (its transposed addition
stays in cache), less than the Python call that would fuse it."""


@dataclass
class Linear:
    """A fusible linear layer ``y = x @ W.T + b`` (``transposed``) or ``y = x @ W + b``,
    and (once known) the gradient of ``y``."""

    node: Any
    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor | None
    transposed: bool
    grad: torch.Tensor | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        """The weight, and the bias if any."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def input_edge(self) -> Any:
        """The autograd node that receives the gradient of ``x`` (``None``: none)."""
        index = 1 if self.node.name() == "AddmmBackward0" else 0
        return self.node.next_functions[index][0]

    def accumulate(self, grad: torch.Tensor | None, pool: GradientPool | None) -> None:
        """Add this micro-batch's weight (and bias) gradient, given the gradient of ``y``,
        into ``.grad`` in place; the first one of a step writes into ``pool``'s buffer."""
        x = self.x
        if grad is None or x is None:
            return
        with torch.no_grad():  # the saved input requires grad; the accumulation must not
            a, b = (grad.t(), x) if self.transposed else (x.t(), grad)
            if self.weight.grad is None:
                buffer = pool.take(self.weight) if pool is not None else None
                self.weight.grad = a.mm(b) if buffer is None else torch.mm(a, b, out=buffer)
                if pool is not None:
                    pool.lend(self.weight, self.weight.grad)
            else:
                self.weight.grad.addmm_(a, b)
            if self.bias is not None:
                if self.bias.grad is None:
                    self.bias.grad = grad.sum(0)
                else:
                    self.bias.grad.add_(grad.sum(0))
        self.x = None  # the layer's input is not needed any more

    def run(self, pool: GradientPool | None) -> None:
        """Accumulate with the gradient kept in :attr:`grad` (the split backward)."""
        grad, self.grad = self.grad, None
        self.accumulate(grad, pool)


def children(node: Any) -> list[Any]:
    """The nodes ``node`` passes gradients to."""
    return [child for child, _ in node.next_functions if child is not None]


def walk(roots: Iterable[Any]) -> tuple[list[Any], dict[Any, int]]:
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
        for child in children(node):
            consumers[child] = consumers.get(child, 0) + 1
            if child not in seen:
                stack.append((child, False))
    return order, consumers


def _has_hooks(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, "_backward_hooks", None)) or bool(
        getattr(tensor, "_post_accumulate_grad_hooks", None)
    )


def _own_param(node: Any, consumers: dict[Any, int], params: set[int]) -> torch.Tensor | None:
    """The parameter accumulated by ``node`` if it is one of ``params`` used only once."""
    if node is None:
        return None
    param = getattr(node, "variable", None)
    if param is None or id(param) not in params or consumers.get(node) != 1 or _has_hooks(param):
        return None
    return param  # type: ignore[no-any-return]


def _as_linear(node: Any, consumers: dict[Any, int], params: set[int]) -> Linear | None:
    name = node.name()
    if name == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        (bias_node, _), _, (w_node, _) = node.next_functions
        x = node._saved_mat1
    elif name == "MmBackward0":
        _, (w_node, _) = node.next_functions
        bias_node, x = None, node._saved_self
    else:
        return None
    transposed = w_node is not None and w_node.name() == "TBackward0"
    if transposed:
        if consumers.get(w_node) != 1:
            return None
        w_node = w_node.next_functions[0][0]
    weight = _own_param(w_node, consumers, params)
    if weight is None or weight.dim() != 2 or x is None or x.dim() != 2 or x.dtype != weight.dtype:
        return None
    bias = None
    if bias_node is not None:
        bias = _own_param(bias_node, consumers, params)
        if bias is None or bias.dim() != 1:
            return None
    return Linear(node, weight, bias, x, transposed)


def find_linears(order: Iterable[Any], consumers: dict[Any, int],
                 params: Iterable[torch.Tensor], *, min_elements: int = 0) -> dict[Any, Linear]:
    """The fusible linear layers among the nodes ``order`` (from :func:`walk`) whose
    weights are among ``params`` and have at least ``min_elements`` elements, by node.

    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> y = lin(torch.randn(4, 3, requires_grad=True))
        >>> order, consumers = walk([y.grad_fn])
        >>> [l.weight is lin.weight for l in find_linears(order, consumers, lin.parameters()).values()]
        [True]
    """
    ids = {id(p) for p in params if p.requires_grad and (p.dim() != 2 or p.numel() >= min_elements)}
    found: dict[Any, Linear] = {}
    for node in order:
        linear = _as_linear(node, consumers, ids)
        if linear is not None:
            found[node] = linear
    return found
