"""Training-mode switches and devices of a captured graph.

A graph captured in training mode holds ``dropout(x, p, train=True)``, ``batch_norm(...,
training=True)`` and ``scaled_dot_product_attention(..., dropout_p=p)`` with those flags
as constants, and the in-place updates of buffers (``num_batches_tracked += 1``) as
plain operations. :func:`route_mode_switches` replaces each such call by a
:class:`ModeSwitch` submodule, so that ``.train()`` / ``.eval()`` of the stage turn them
on and off as they would in the model, and a recomputed micro-batch (re-materialization)
does not update running statistics a second time.

Devices written into the graph at capture (``torch.arange(..., device=...)``; ``meta``
for a model built on the meta device) are rewritten to the stage's device by
:func:`retarget_devices`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx, nn

from pipetrain.checkpoint import is_recomputing

__all__ = ["ModeSwitch", "retarget_devices", "route_mode_switches"]

_aten = torch.ops.aten
_DROPOUTS = {_aten.dropout.default, _aten.feature_dropout.default,
             _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default}
# which argument to change, by position and name, and its value outside training
_SWITCHES: dict[Any, tuple[str, int, str, Any]] = {
    **{op: ("dropout", 2, "train", False) for op in _DROPOUTS},
    _aten.batch_norm.default: ("batch_norm", 5, "training", False),
    _aten.scaled_dot_product_attention.default: ("attention", 4, "dropout_p", 0.0),
}


def _set(args: list[Any], kwargs: dict[str, Any], index: int, name: str, value: Any) -> None:
    if name in kwargs or len(args) <= index:
        kwargs[name] = value
    else:
        args[index] = value


class ModeSwitch(nn.Module):
    """One operation of a captured graph that behaves as in training only while the
    stage is in training mode (``kind``: ``dropout``, ``batch_norm``, ``attention``
    dropout, or an in-place ``buffer_update`` that is skipped outside training and
    while recomputing).

    Example:
        >>> switch = ModeSwitch(torch.ops.aten.dropout.default, "dropout", 2, "train", False)
        >>> x = torch.ones(4)
        >>> torch.equal(switch.eval()(x, 0.5, True), x)
        True
    """

    def __init__(self, op: Callable[..., Any], kind: str, index: int, name: str,
                 off: Any) -> None:
        super().__init__()
        self.op = op
        self.kind = kind
        self.index = index
        self.name = name
        self.off = off

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values, named = list(args), dict(kwargs)
        if self.kind == "buffer_update":
            if not self.training or is_recomputing():
                return values[0]
        elif self.kind == "batch_norm":
            if self.training and is_recomputing():
                values[3:5] = [None, None]  # the batch's statistics, no second update
            elif not self.training and values[3] is not None:
                _set(values, named, self.index, self.name, self.off)
        elif not self.training:
            _set(values, named, self.index, self.name, self.off)
        return self.op(*values, **named)

    def extra_repr(self) -> str:
        return f"{self.op}, {self.kind}"


def _is_inplace(target: Any) -> bool:
    name = str(target).split(".")
    return len(name) >= 2 and name[1].endswith("_") and not name[1].startswith("_")


def _switch_of(node: fx.Node, buffers: Collection[str]) -> tuple[Any, ...] | None:
    """The :class:`ModeSwitch` arguments for ``node``, or ``None`` if it needs none."""
    if node.op != "call_function":
        return None
    if node.target in _SWITCHES:
        return (node.target, *_SWITCHES[node.target])
    if (_is_inplace(node.target) and node.args and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "get_attr" and node.args[0].target in buffers):
        return (node.target, "buffer_update", 0, "self", None)
    return None


def route_mode_switches(graph: fx.Graph, *, buffers: Collection[str], owner: nn.Module) -> None:
    """Route ``graph``'s mode-dependent operations through :class:`ModeSwitch`
    submodules of ``owner`` (in place; operations that switch alike share one submodule,
    which takes ``owner``'s mode). ``buffers`` are the attribute names that are buffers
    (their in-place updates are switched).

    Example:
        >>> graph = fx.Graph()
        >>> x = graph.placeholder("x")
        >>> _ = graph.output(graph.call_function(torch.ops.aten.dropout.default, (x, 0.5, True)))
        >>> owner = nn.Module().eval()
        >>> route_mode_switches(graph, buffers=(), owner=owner)
        >>> [(name, m.training) for name, m in owner.named_children()]
        [('pipetrain_mode_0', False)]
    """
    existing = {(m.op, m.kind, m.index, m.name, m.off): name
                for name, m in owner.named_children() if isinstance(m, ModeSwitch)}
    for node in list(graph.nodes):
        arguments = _switch_of(node, buffers)
        if arguments is None:
            continue
        name = existing.get(arguments)
        if name is None:
            name = f"pipetrain_mode_{len(existing)}"
            owner.add_module(name, ModeSwitch(*arguments).train(owner.training))
            existing[arguments] = name
        node.op, node.target = "call_module", name


def retarget_devices(graph: fx.Graph, device: torch.device, *,
                     captured_on: Collection[torch.device]) -> None:
    """Replace the devices of ``captured_on`` (and ``meta``) in ``graph``'s arguments by
    ``device`` (in place).

    Example:
        >>> graph = fx.Graph()
        >>> node = graph.call_function(torch.zeros, (2,), {"device": torch.device("meta")})
        >>> retarget_devices(graph, torch.device("cpu"), captured_on=())
        >>> node.kwargs["device"]
        device(type='cpu')
    """
    old = {torch.device("meta"), *captured_on} - {device}

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value in old:
            return device
        if isinstance(value, (tuple, list)):
            return type(value)(swap(v) for v in value)
        return value

    for node in graph.nodes:
        node.args = tuple(swap(a) for a in node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
