"""The torch releases pipetrain supports, and the private torch names it reads (gated here).

pipetrain supports torch :data:`OLDEST_TORCH` to :data:`NEWEST_TORCH` (``pyproject.toml``
declares the same range). Code that depends on the installed release, or that reads a
name torch does not promise to keep, lives in this module and nowhere else, so that a
torch upgrade has one place to check (``docs/runtime.md`` lists every such name).

Today that is whether torch.export traces a meta-device model with example inputs on
another device (:func:`export_meta_models_on_meta_inputs`), and the fused backward's
view of autograd's graph (:mod:`pipetrain.backward`):
which node is the GEMM of a linear layer, the input autograd saved for it, and whether a
parameter carries Python hooks. Torch exposes these only through private attributes
(``grad_fn._saved_mat1``, ``Tensor._backward_hooks``) and generated node names
(``AddmmBackward0``). :func:`fused_gemm_supported` gates them: the installed torch must
lie in the supported range, and a probe on a tiny linear layer must find every one of
them behaving as expected. Otherwise the fused path is off (autograd accumulates every
gradient: the same gradients, without the speed-up) and one warning says why. The tests
assert that the gate is open on every torch they run on, so a release that drops one of
these names fails them instead of silently turning the fast path off.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "NEWEST_TORCH",
    "OLDEST_TORCH",
    "GemmNode",
    "export_meta_models_on_meta_inputs",
    "fused_gemm_supported",
    "gemm_node",
    "has_grad_hooks",
    "torch_version",
    "transposed_input",
]

logger = logging.getLogger(__name__)

OLDEST_TORCH = (2, 11)
"""The oldest torch release (major, minor) pipetrain supports and is tested on."""
NEWEST_TORCH = (2, 15)
"""The newest torch release (major, minor) pipetrain supports."""

_ADDMM, _MM, _TRANSPOSE = "AddmmBackward0", "MmBackward0", "TBackward0"


def torch_version(text: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (default: the installed torch).

    Example:
        >>> torch_version("2.11.0+cu130"), torch_version("2.16.0a0+git1234")
        ((2, 11), (2, 16))
    """
    text = torch.__version__ if text is None else text
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r} (expected e.g. '2.13.0')")
    return int(found[1]), int(found[2])


def export_meta_models_on_meta_inputs(version: tuple[int, int] | None = None) -> bool:
    """Whether ``torch.export`` must be given a model built on the meta device with its
    example inputs on the meta device too (torch before 2.13: its fake tensors refuse an
    operation that mixes meta parameters with CPU inputs, "Unhandled FakeTensor Device
    Propagation ... found two different devices meta, cpu"). Default: the installed torch.

    Example:
        >>> export_meta_models_on_meta_inputs((2, 11)), export_meta_models_on_meta_inputs((2, 13))
        (True, False)
    """
    return (torch_version() if version is None else version) < (2, 13)


@dataclass(frozen=True)
class GemmNode:
    """An autograd node computing ``out = bias + x @ w`` (``addmm`` with ``alpha = beta =
    1``) or ``out = x @ w`` (``mm``), as the fused backward needs it."""

    x: torch.Tensor | None
    """the input autograd saved for the weight's gradient (``None`` if it saved none)"""
    x_edge: int
    """the index in ``node.next_functions`` of the edge ``x``'s gradient leaves by"""
    weight: Any
    """the node that receives ``w``'s gradient (a transpose's node for ``x @ W.T``)"""
    bias: Any
    """the node that receives the bias's gradient (``None`` for ``mm``)"""


def gemm_node(node: Any) -> GemmNode | None:
    """``node`` read as a GEMM of a saved input, or ``None`` (another op, an ``addmm``
    with scaling factors, or the gate :func:`fused_gemm_supported` closed).

    Example:
        >>> lin = torch.nn.Linear(2, 3)
        >>> x = torch.ones(4, 2, requires_grad=True)
        >>> gemm = gemm_node(lin(x).grad_fn)
        >>> torch.equal(gemm.x, x), gemm.x_edge
        (True, 1)
        >>> gemm_node((x * 2).grad_fn) is None
        True
    """
    if not fused_gemm_supported():
        return None
    return _read_gemm(node)


def transposed_input(node: Any) -> Any:
    """If ``node`` is the backward of a transpose (``W.T``), the node it passes its
    gradient to (the one of ``W``); else ``None``.

    Example:
        >>> w = torch.ones(2, 2, requires_grad=True)
        >>> from torch.autograd.graph import get_gradient_edge
        >>> transposed_input(w.t().grad_fn) is get_gradient_edge(w).node
        True
    """
    if node is None or node.name() != _TRANSPOSE:
        return None
    return node.next_functions[0][0]


def has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries hooks from ``Tensor.register_hook`` or
    ``Tensor.register_post_accumulate_grad_hook`` (``True`` when the gate is closed:
    then nothing can tell).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> has_grad_hooks(w)
        False
        >>> handle = w.register_post_accumulate_grad_hook(lambda p: None)
        >>> has_grad_hooks(w)
        True
    """
    return not fused_gemm_supported() or _read_hooks(tensor)


def _read_gemm(node: Any) -> GemmNode | None:
    name = node.name()
    if name == _ADDMM:
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        (bias, _), _, (weight, _) = node.next_functions
        return GemmNode(node._saved_mat1, 1, weight, bias)
    if name == _MM:
        _, (weight, _) = node.next_functions
        return GemmNode(node._saved_self, 0, weight, None)
    return None


def _read_hooks(tensor: torch.Tensor) -> bool:
    return bool(tensor._backward_hooks) or bool(tensor._post_accumulate_grad_hooks)


def _probe() -> str | None:
    """What does not behave as the fused backward expects on this torch (``None``: all
    does): a linear layer's ``addmm`` node, an ``mm`` node, and both kinds of hooks."""
    from torch.autograd.graph import get_gradient_edge

    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        # no draws from torch's generator: the probe must not change a run's random stream;
        # no meta device either: its first CPU tensor imports torch's Python meta kernels
        # (about 33 MiB resident, for the whole process)
        weight = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2))
        bias = torch.nn.Parameter(torch.full((3,), 0.5))
        x = torch.arange(8.0).reshape(4, 2).requires_grad_()
        gemm = _read_gemm(torch.nn.functional.linear(x, weight, bias).grad_fn)
        if gemm is None or gemm.x is None or not torch.equal(gemm.x, x):
            return f"a linear layer's node is not read as {_ADDMM} of its saved input"
        if gemm.bias is not get_gradient_edge(bias).node:
            return f"{_ADDMM}'s first edge does not lead to the bias"
        if transposed_input(gemm.weight) is not get_gradient_edge(weight).node:
            return f"{_ADDMM}'s last edge does not lead through {_TRANSPOSE} to the weight"
        mm = _read_gemm(torch.mm(x, weight.t()).grad_fn)
        if mm is None or mm.x is None or not torch.equal(mm.x, x):
            return f"torch.mm's node is not read as {_MM} of its saved input"
        if _read_hooks(weight):
            return "a parameter without hooks reads as having some"
        handle = weight.register_hook(lambda grad: None)  # type: ignore[no-untyped-call]
        seen = _read_hooks(weight)
        handle.remove()
        if not seen or _read_hooks(weight):
            return "a hook of Tensor.register_hook is not seen (or seen once removed)"
        handle = bias.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda param: None)
        seen = _read_hooks(bias)
        handle.remove()
        if not seen:
            return "a hook of Tensor.register_post_accumulate_grad_hook is not seen"
    return None


_lock = threading.Lock()
_decided: list[bool] = []


def fused_gemm_supported() -> bool:
    """Whether the fused backward may read autograd's GEMM nodes on this torch (decided
    once per process; a warning says why not).

    Example:
        >>> fused_gemm_supported()   # on a supported torch
        True
    """
    if _decided:
        return _decided[0]
    with _lock:
        if not _decided:
            _decided.append(_decide(torch_version()))
    return _decided[0]


def _decide(version: tuple[int, int]) -> bool:
    def shown(v: tuple[int, int]) -> str:
        return f"{v[0]}.{v[1]}"

    reason: str | None
    if not OLDEST_TORCH <= version <= NEWEST_TORCH:
        reason = (f"torch {torch.__version__} is outside the releases pipetrain supports "
                  f"({shown(OLDEST_TORCH)} to {shown(NEWEST_TORCH)})")
    else:
        try:
            reason = _probe()
        except Exception as error:  # an attribute gone, a changed signature: off, not broken
            reason = f"{type(error).__name__}: {error}"
    if reason is None:
        return True
    logger.warning(
        "pipetrain's fused weight-gradient accumulation is off: %s. Autograd accumulates "
        "every gradient instead (the same gradients, a slower backward); fix: install a "
        "torch release from %s to %s", reason, shown(OLDEST_TORCH), shown(NEWEST_TORCH))
    return False
