"""Capturing a model again for sizes its first graph does not serve.

A model whose code pins a size (``int(x.shape[0])``, a loop over the batch, a branch on
the size, or any model captured with static shapes) yields a graph that serves only
some sizes (:mod:`pipetrain.frontend.sizes`). A micro-batch of other sizes gets its own
capture: :func:`capture_at` captures the model on its example inputs cut or repeated to
those sizes (the values stay valid inputs: token ids remain token ids), in a thread of
its own (so that no grad mode, autocast or saved-tensor hook of the running step leaks
into the capture). A model built on the meta device, of which each rank has made only
its own stage real, is captured as a :func:`meta_skeleton` of it (as it was captured
first: all on ``meta``, no memory). :func:`matched_to` checks that the new graph cuts into the same units
reading the same tensors, so that the units built from the first capture run it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from pipetrain.frontend.capture import CONSTANT_PREFIX, CapturedGraph, capture
from pipetrain.frontend.errors import CaptureError
from pipetrain.frontend.inputs import Path, leaves_with_paths
from pipetrain.frontend.sizes import Sizes
from pipetrain.frontend.units import UnitPlan

__all__ = ["capture_at", "matched_to", "meta_skeleton", "resized"]

_FIX = ("pass example_inputs of one micro-batch's size (the batch size divided by "
        "num_microbatches / chunks) and batches that divide evenly into micro-batches, or "
        "make the model's code keep the batch size symbolic (no int(x.shape[0]), no "
        "Python loop over the batch)")


def resized(tensor: torch.Tensor, *, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` cut or repeated along each dim to ``shape`` (its values reused).

    Example:
        >>> resized(torch.tensor([[1, 2, 3]]), shape=(2, 2)).tolist()
        [[1, 2], [1, 2]]
    """
    if any(d == 0 for d in tensor.shape):
        return tensor.new_zeros(shape)
    repeats = [max(1, math.ceil(s / d)) for s, d in zip(shape, tensor.shape)]
    big = tensor.detach().repeat(repeats) if repeats else tensor.detach()
    return big[tuple(slice(0, s) for s in shape)].clone()


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are all on the meta device (ties
    kept; nothing allocated, nothing of ``model`` changed).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> model[1].weight = model[0].weight
        >>> skeleton = meta_skeleton(model)
        >>> skeleton[0].weight.is_meta, skeleton[1].weight is skeleton[0].weight
        (True, True)
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(meta, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(model, memo)


def _replaced(value: Any, path: Path, new: torch.Tensor) -> Any:
    if not path:
        return new
    key, *rest = path
    if isinstance(value, dict):
        return {k: _replaced(v, tuple(rest), new) if k == key else v for k, v in value.items()}
    assert isinstance(value, (tuple, list)) and isinstance(key, int), (value, path)
    items = [_replaced(v, tuple(rest), new) if i == key else v for i, v in enumerate(value)]
    return type(value)(items)


def _adopt_constants(captured: CapturedGraph, example: CapturedGraph, *, sizes: Sizes,
                     model: nn.Module) -> None:
    """Rename ``captured``'s lifted constants to the example's equal ones (in place)."""
    names: dict[str, str] = {}
    for name, tensor in captured.constants.items():
        same = [n for n, t in example.constants.items()
                if t.shape == tensor.shape and t.dtype == tensor.dtype and torch.equal(t, tensor)]
        if not same:
            raise CaptureError(
                f"{type(model).__name__} captured at sizes {sizes} creates a constant tensor "
                f"of shape {tuple(tensor.shape)} that its capture on the example does not "
                f"(a constant that depends on the batch size); fix: {_FIX}"
            )
        names[name] = same[0]
    for node in captured.graph.nodes:
        if node.op == "get_attr" and str(node.target).startswith(CONSTANT_PREFIX):
            node.target = names[str(node.target)]
    captured.constants = {names[n]: t for n, t in captured.constants.items()}


def _shown(captured: CapturedGraph, sizes: Sizes) -> str:
    return ", ".join(f"{label} {shape}" for label, shape in zip(captured.binding.labels, sizes))


def capture_at(model: nn.Module, *, sample: Mapping[str, Any], example: CapturedGraph,
               sizes: Sizes) -> CapturedGraph:
    """``model`` captured on its example inputs ``sample`` resized to ``sizes`` (the
    shapes of the tensor inputs in graph order); ``example`` is the first capture.

    Raises:
        CaptureError: the model cannot be captured at ``sizes`` (the message says why the
            first graph does not serve them, what failed and the fix).
    """
    named: Any = dict(sample)
    binding = example.binding
    found = dict(leaves_with_paths(named))
    for path, shape in zip(binding.slots, sizes):
        named = _replaced(named, path, resized(found[path], shape=shape))
    reason = example.sizes.why_not(sizes)
    shown = _shown(example, sizes)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipetrain-capture") as pool:
            captured = pool.submit(capture, model, named).result()
    except CaptureError as error:
        raise CaptureError(
            f"a micro-batch of {shown} is not served by the graph of {type(model).__name__} "
            f"captured on the example ({reason}), and capturing it at these sizes failed "
            f"({error}); or else {_FIX}"
        ) from error
    _adopt_constants(captured, example, sizes=sizes, model=model)
    return captured


def matched_to(plan: UnitPlan, *, example: UnitPlan, model: nn.Module, sizes: Sizes) -> UnitPlan:
    """``plan`` (a capture at ``sizes``) if it has the example's units, each reading no
    tensor the example's unit does not.

    Raises:
        CaptureError: it does not (naming the unit and the tensors).
    """
    problem = None
    if plan.num_units != example.num_units:
        problem = (f"its graph there has {plan.num_units} units where a stage may begin, the "
                   f"example's {example.num_units}")
    else:
        for unit, (names, known) in enumerate(zip(plan.attributes, example.attributes)):
            extra = sorted(set(names) - set(known))
            if extra:
                problem = (f"unit {unit} of its graph there reads {extra}, which that unit "
                           "does not read on the example")
                break
    if problem is not None:
        raise CaptureError(
            f"{type(model).__name__} captured for a micro-batch of {_shown(plan.captured, sizes)} "
            f"(which the graph captured on the example does not serve: "
            f"{example.captured.sizes.why_not(sizes)}) runs "
            f"different layers: {problem}; fix: {_FIX}"
        )
    return plan
