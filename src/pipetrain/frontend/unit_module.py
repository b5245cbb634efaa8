"""``CapturedUnit``: one unit of a captured model as a module, running the capture that
serves the sizes of its micro-batch.

A unit holds the tensors it reads under the model's own names and runs its part of a
captured graph (:func:`~pipetrain.frontend.units.unit_graph`), compiled to Python as
``torch.fx`` compiles a ``GraphModule``. Which graph: unit 0 reads the batch and asks its
:class:`GraphSource` for the capture that serves the batch's sizes
(:mod:`pipetrain.frontend.sizes`): the example's, or one made for other sizes (a
micro-batch smaller than the example when the model's code pins the batch size, an
uneven last micro-batch of 1 sample, ...). A message made by a capture other than the
example's starts with :data:`SIZED` and the sizes that capture was made at, so every
later unit, in this process or another, runs its part of the same capture (captured
there too the first time). The example's capture sends its messages as they are.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import torch
from torch import fx, nn

from pipetrain.frontend.inputs import InputBinding
from pipetrain.frontend.modes import retarget_devices, route_mode_switches
from pipetrain.frontend.sizes import Sizes
from pipetrain.frontend.units import UnitPlan, unit_graph

__all__ = ["SIZED", "CapturedUnit", "GraphSource"]

SIZED = "pipetrain.sized"
"""The first element of a message made by a capture other than the example's."""


class GraphSource(Protocol):
    """Where units find their graphs (:class:`~pipetrain.frontend.source.CapturedModel`)."""

    def choose(self, tensors: Sequence[torch.Tensor]) -> Sizes | None:
        """The sizes of the capture that serves a batch of ``tensors`` (``None``: the
        example's)."""

    def plan_for(self, sizes: Sizes | None) -> UnitPlan:
        """The units of the capture made at ``sizes`` (``None``: the example's)."""


def _compile(graph: fx.Graph, name: str) -> Callable[..., Any]:
    code = graph.python_code(root_module="self")
    filename = f"<{name}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # fx compiles its graphs so too
    forward: Callable[..., Any] = namespace["forward"]
    return forward


class CapturedUnit(nn.Module):
    """Unit ``unit`` of a captured model: ``forward(message) -> message`` (see the module
    docstring). Its parameters and buffers are the model's, under the model's names.

    Example:
        >>> from pipetrain.frontend.source import CapturedModel
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> unit = CapturedModel.create(model, (torch.randn(3, 4),)).build(0)
        >>> sorted(name for name, _ in unit.named_parameters())
        ['0.bias', '0.weight']
        >>> x = torch.randn(5, 4)
        >>> torch.equal(unit(x)[0], model[0](x))
        True
    """

    def __init__(self, source: GraphSource, unit: int, *, num_units: int,
                 binding: InputBinding, device: torch.device,
                 captured_on: Collection[torch.device], buffers: Collection[str]) -> None:
        super().__init__()
        self._graph_source = source
        self._unit_index = unit
        self._is_last = unit == num_units - 1
        self._input_binding = binding
        self._unit_device = device
        self._devices_at_capture = tuple(captured_on)
        self._buffer_names = frozenset(buffers)
        self._compiled: dict[Sizes | None, Callable[..., Any]] = {}
        self._torch_compile: dict[str, Any] | None = None

    @property
    def source(self) -> GraphSource:
        """Where this unit's graphs come from (the captured model)."""
        return self._graph_source

    def prepare(self, sizes: Sizes | None) -> Callable[..., Any]:
        """This unit's part of the capture made at ``sizes`` (``None``: the example's),
        compiled (once)."""
        code = self._compiled.get(sizes)
        if code is None:
            graph = unit_graph(self._graph_source.plan_for(sizes), self._unit_index)
            retarget_devices(graph, self._unit_device, captured_on=self._devices_at_capture)
            route_mode_switches(graph, buffers=self._buffer_names, owner=self)
            graph.lint()
            where = "" if sizes is None else f" at {sizes}"
            code = _compile(graph, f"pipetrain unit {self._unit_index}{where} #{len(self._compiled)}")
            if self._torch_compile is not None:
                code = torch.compile(code, **self._torch_compile)
            self._compiled[sizes] = code
        return code

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile this unit's graphs with ``torch.compile`` (its keyword arguments), each
        graph on its own: ``nn.Module.compile`` would trace the routing of every unit
        through one shared ``forward`` and exhaust torch.compile's recompile limit (then
        run eager without a word) once a few units or sizes pass through it.

        Example:
            >>> from pipetrain.frontend.source import CapturedModel
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            >>> unit = CapturedModel.create(model, (torch.randn(3, 4),)).build(0)
            >>> unit.compile(backend="eager")
            >>> x = torch.randn(3, 4)
            >>> torch.allclose(unit(x)[0], model[0](x))
            True
        """
        if args:
            raise TypeError("CapturedUnit.compile takes torch.compile's keyword arguments only")
        self._torch_compile = dict(kwargs)
        self._compiled.clear()

    def _route(self, message: Any) -> tuple[Sizes | None, Any]:
        if self._unit_index == 0:
            tensors = self._input_binding.read(message)
            return self._graph_source.choose(tensors), tensors
        if (isinstance(message, (tuple, list)) and len(message) >= 2
                and isinstance(message[0], str) and message[0] == SIZED):
            return tuple(tuple(int(d) for d in shape) for shape in message[1]), message[2:]
        return None, message

    def forward(self, message: Any) -> Any:
        sizes, values = self._route(message)
        output = self.prepare(sizes)(self, values)
        if sizes is None or self._is_last:
            return output
        return (SIZED, sizes, *output)

    def extra_repr(self) -> str:
        return f"unit={self._unit_index}, captures={len(self._compiled)}"
