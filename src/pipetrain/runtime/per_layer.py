"""Per-layer re-materialization: a stage's backward rebuilt one layer at a time.

With ``checkpoint="always"`` a micro-batch keeps only its stage input and its backward
first rebuilds the whole stage's graph, so the backward holds the activations of every
layer of the stage at once. The ``per_layer`` mode keeps the input of every layer instead
(the forward runs without a graph) and its backward walks the layers from the last:
rebuild layer ``k`` from its kept input, back-propagate through it, hand the gradient of
its input to layer ``k - 1``. The compute is the same (one extra forward), what a
micro-batch holds between its forward and backward is its layers' inputs, and what its
backward holds is one layer's activations (Megatron-LM's ``--recompute-granularity full
--recompute-method uniform --recompute-num-layers 1``, torchtitan's per-block full
activation checkpointing, without the autograd graph that torch's checkpoint keeps for
every layer and micro-batch in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipetrain.backward.roots import start_points
from pipetrain.nested import iter_tensors, map_tensors

__all__ = ["backward_by_layer", "packed"]


def packed(inputs: list[Any]) -> list[Any]:
    """``inputs`` (a stage's layers' inputs) with all but the first copied into one buffer,
    as views of it, when they are tensors of one dtype and device: one allocation per
    micro-batch instead of one per layer (small tensors kept among a forward's freed
    temporaries otherwise pin the allocator's pages between them: on the CPU a stage of 25
    GPT blocks kept 1.7x its inputs' bytes). The first is the stage's input, kept as it is.

    Example:
        >>> kept = packed([torch.ones(2), torch.zeros(2, 2), torch.full((3,), 2.0)])
        >>> [tuple(t.shape) for t in kept], kept[2].tolist()
        ([(2,), (2, 2), (3,)], [2.0, 2.0, 2.0])
        >>> kept[1].untyped_storage().data_ptr() == kept[2].untyped_storage().data_ptr()
        True
    """
    rest = inputs[1:]
    if len(rest) < 2 or not all(isinstance(t, torch.Tensor) for t in rest) \
            or len({(t.dtype, t.device) for t in rest}) != 1:
        return inputs
    buffer = torch.empty(sum(t.numel() for t in rest), dtype=rest[0].dtype,
                         device=rest[0].device)
    views, at = [], 0
    for tensor in rest:
        view = buffer[at:at + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        views.append(view)
        at += tensor.numel()
    return [inputs[0], *views]


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.detach().requires_grad_(True)
    return tensor


def backward_by_layer(
    inputs: list[Any],
    grads: Sequence[torch.Tensor | None] | None,
    *,
    run_layer: Callable[[int, Any], tuple[Any, torch.Tensor | None]],
    announced: Callable[[torch.Tensor], bool],
) -> None:
    """Back-propagate through layers ``0 .. len(inputs) - 1`` from the last, layer ``k``
    rebuilt from ``inputs[k]`` by ``run_layer(k, value)`` (its output, and the loss if it
    computes one). ``grads`` are the gradients of the last layer's output tensors that
    ``announced`` accepts (None: the last layer's loss starts the backward); ``inputs[0]``
    is used as it is (its leaves receive their ``.grad``), the later inputs are detached.
    Weight gradients accumulate into ``.grad``; ``inputs`` is emptied as it goes.

    Example:
        >>> layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
        >>> x = torch.ones(3, 2, requires_grad=True)
        >>> with torch.no_grad():
        ...     kept = [x, layers[0](x)]
        >>> backward_by_layer(kept, [torch.ones(3, 1)],
        ...                   run_layer=lambda k, v: (layers[k](v), None),
        ...                   announced=lambda t: True)
        >>> y = x.detach().requires_grad_(True)
        >>> layers[1](layers[0](y)).sum().backward()
        >>> torch.allclose(x.grad, y.grad)
        True
    """
    upstream: list[torch.Tensor | None] | None = None if grads is None else list(grads)
    last = len(inputs) - 1
    for k in range(last, -1, -1):
        value = inputs.pop()
        if k > 0:
            value = map_tensors(_leaf, value)
        with torch.enable_grad():
            output, loss = run_layer(k, value)
        root_grads: list[torch.Tensor | None]
        if k == last and loss is not None:
            roots, root_grads = [loss], [None]
        else:
            tensors = [t for t in iter_tensors(output) if k < last or announced(t)]
            if upstream is None or len(tensors) != len(upstream):
                raise RuntimeError(
                    f"layer {k} of the stage has {len(tensors)} outputs that need a gradient "
                    f"but received {0 if upstream is None else len(upstream)} gradients")
            pairs = [(t, g) for t, g in zip(tensors, upstream)
                     if g is not None and t.requires_grad]
            roots, root_grads = [t for t, _ in pairs], [g for _, g in pairs]
        if roots:
            torch.autograd.backward(start_points(roots, root_grads))
        upstream = [t.grad for t in iter_tensors(value)]
        del output, loss, roots, root_grads
