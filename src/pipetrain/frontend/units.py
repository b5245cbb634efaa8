"""Units: a captured graph cut into consecutive pieces, and the values that cross each cut.

Unit ``u`` holds the operations from its start to the next unit's (see
:mod:`pipetrain.frontend.cuts`; a ``getitem`` of a multi-output operation stays with
the operation). A value made in one unit and used in a later one *crosses* every cut
in between: unit ``u``'s message to unit ``u + 1`` is the tuple of every value made at
or before ``u`` and used after it, in graph order, so a skip connection rides along
(through the units that do not use it) to each unit that does, a value used by several
later units (fan-out) travels once, and integer tensors, masks, tensors that need no
gradient and sizes (``int``) travel as they are. Unit 0 takes the model's inputs; the
last unit returns the model's output structure.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from pipetrain.frontend.capture import CapturedGraph
from pipetrain.frontend.cuts import compute_nodes

__all__ = ["UnitPlan", "plan_units", "register_tensor", "unit_graph"]


@dataclass(frozen=True)
class UnitPlan:
    """What each unit computes, takes and passes on (the same on every process)."""

    captured: CapturedGraph
    nodes: tuple[tuple[fx.Node, ...], ...]
    """Each unit's operations, in graph order."""
    inputs: tuple[tuple[fx.Node, ...], ...]
    """The values each unit receives (unit 0: the graph's placeholders)."""
    attributes: tuple[tuple[str, ...], ...]
    """The parameters, buffers and constants each unit reads, by name."""

    @property
    def num_units(self) -> int:
        return len(self.nodes)

    def outputs(self, unit: int) -> tuple[fx.Node, ...]:
        """The values unit ``unit`` passes on (the next unit's inputs)."""
        return self.inputs[unit + 1] if unit + 1 < self.num_units else ()


def plan_units(captured: CapturedGraph, starts: list[int]) -> UnitPlan:
    """Cut ``captured`` into units beginning at ``starts`` (positions in its operations;
    the first is 0).

    Example:
        >>> from torch import nn
        >>> from pipetrain.frontend.capture import capture
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> plan = plan_units(capture(model, {"input": torch.ones(2, 2)}), [0, 1])
        >>> plan.num_units, [len(i) for i in plan.inputs], plan.attributes
        (2, [1, 1], (('0.weight', '0.bias'), ()))
    """
    graph = captured.graph
    operations = compute_nodes(graph)
    unit_of: dict[fx.Node, int] = {}
    for position, node in enumerate(operations):
        unit = bisect.bisect_right(starts, position) - 1
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, fx.Node) and source in unit_of:
            unit = unit_of[source]  # keep a multi-output operation's pieces together
        unit_of[node] = unit
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = len(starts) - 1
    made = {**{p: 0 for p in placeholders}, **unit_of}
    used_until: dict[fx.Node, int] = {}
    for node in graph.nodes:
        user_unit = last if node.op == "output" else unit_of.get(node)
        if user_unit is None:
            continue
        for value in node.all_input_nodes:
            if value in made:
                used_until[value] = max(used_until.get(value, 0), user_unit)
    order = {node: k for k, node in enumerate(graph.nodes)}
    inputs: list[tuple[fx.Node, ...]] = [tuple(placeholders)]
    for unit in range(1, last + 1):
        crossing = [v for v in made if made[v] < unit <= used_until.get(v, -1)]
        inputs.append(tuple(sorted(crossing, key=order.__getitem__)))
    nodes = tuple(tuple(n for n in operations if unit_of[n] == u) for u in range(last + 1))
    attributes = tuple(
        tuple(dict.fromkeys(str(a.target) for n in unit_nodes for a in n.all_input_nodes
                            if a.op == "get_attr"))
        for unit_nodes in nodes
    )
    return UnitPlan(captured, nodes, tuple(inputs), attributes)


def register_tensor(module: torch.nn.Module, name: str, value: torch.Tensor, persistent: bool) -> None:
    """Register ``value`` as parameter / buffer ``name`` (dotted) of ``module``, creating
    the submodules on the way."""
    *path, attr = name.split(".")
    for part in path:
        child = getattr(module, part, None)
        if child is None:
            child = torch.nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(attr, value)
    else:
        module.register_buffer(attr, value, persistent=persistent)


class Rebuild:
    """Rebuilds the model's output structure from its leaves (a graph calls
    :meth:`output`)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def output(self, leaves: list[Any]) -> Any:
        return self.spec.unflatten(leaves)


def unit_graph(plan: UnitPlan, unit: int) -> fx.Graph:
    """Unit ``unit``'s graph: ``forward(message)`` where ``message`` is the tuple of its
    inputs (unit 0: the model's tensor inputs, in graph order); it returns the values it
    passes on, the last unit the model's output structure."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    message = graph.placeholder("message")
    for index, value in enumerate(plan.inputs[unit]):
        env[value] = graph.call_function(operator.getitem, (message, index))

    def lookup(node: fx.Node) -> Any:
        if node not in env:  # an attribute read by this unit
            env[node] = graph.get_attr(str(node.target))
        return env[node]

    for node in plan.nodes[unit]:
        env[node] = graph.node_copy(node, lookup)
    if unit == plan.num_units - 1:
        output_node = next(n for n in plan.captured.graph.nodes if n.op == "output")
        leaves = [lookup(v) if isinstance(v, fx.Node) else v for v in output_node.args[0]]
        rebuild = Rebuild(plan.captured.out_spec)
        graph.output(graph.call_function(rebuild.output, (leaves,)))
    else:
        graph.output(tuple(env[v] for v in plan.outputs(unit)))
    return graph
