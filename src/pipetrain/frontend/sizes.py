"""Input sizes: which sizes of its tensor inputs a captured graph serves.

torch.export keeps a dim symbolic only over a range (at least 2 by default, so that
sizes 0 and 1, which broadcast differently, are not assumed away; a model's own checks
narrow it further: ``if x.shape[0] > 4``, a position table of 64 entries) and fixes the
dims that the model's Python pins (``int(x.shape[0])``, a loop over the batch, or every
dim of a graph captured with static shapes). :class:`InputSizes` records, per tensor
input and dim, the size or the symbol the graph was captured with and the ranges of the
symbols; :meth:`InputSizes.why_not` tells whether a batch's sizes are served, and if not,
why (a graph run outside them would fail with a shape error, or take the wrong branch).

Example:
    >>> from torch import nn
    >>> class Rows(nn.Module):
    ...     def forward(self, x):
    ...         return torch.stack([x[i] * i for i in range(x.shape[0])])
    >>> program = torch.export.export(Rows(), (), {"x": torch.ones(4, 3)}, strict=False,
    ...                               dynamic_shapes={"x": {0: torch.export.Dim.AUTO}})
    >>> sizes = InputSizes.of(program, labels=("x",))
    >>> sizes.why_not(((4, 3),)) is None
    True
    >>> sizes.why_not(((2, 3),))
    'x dim 0 is 2, captured fixed at 4'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

__all__ = ["InputSizes", "Sizes", "sizes_of"]

Sizes = tuple[tuple[int, ...], ...]
"""The shapes of a batch's tensor inputs, in graph order."""

def sizes_of(tensors: Sequence[torch.Tensor]) -> Sizes:
    """The shapes of ``tensors`` as a :data:`Sizes`.

    Example:
        >>> sizes_of([torch.zeros(2, 3), torch.zeros(5)])
        ((2, 3), (5,))
    """
    return tuple(tuple(int(d) for d in t.shape) for t in tensors)


def _expr(dim: Any) -> Any:
    import sympy  # only where a graph is captured (torch.export imports it then anyway)

    expr = dim.node.expr if isinstance(dim, torch.SymInt) else dim
    return int(expr) if isinstance(expr, (int, sympy.Integer)) else expr


def _bound(value: Any) -> int | None:
    import sympy

    return int(value) if isinstance(value, (int, sympy.Integer)) else None


@dataclass(frozen=True)
class InputSizes:
    """The sizes a captured graph serves (see the module docstring)."""

    labels: tuple[str, ...]
    """Each tensor input's name (``input_ids``, ``pair[1]``)."""
    dims: tuple[tuple[Any, ...], ...]
    """Per tensor input, per dim: a fixed ``int`` or a sympy expression of symbols."""
    ranges: tuple[tuple[Any, int, int | None], ...]
    """``(expression, least, largest)`` of each constrained expression (``None``: no limit)."""
    captured_at: Sizes
    _verdicts: dict[Sizes, str | None] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(program: ExportedProgram, *, labels: Sequence[str]) -> InputSizes:
        """The sizes ``program`` serves; ``labels`` name its tensor inputs in order."""
        values = [node.meta.get("val") for node, spec in
                  zip([n for n in program.graph.nodes if n.op == "placeholder"],
                      program.graph_signature.input_specs)
                  if spec.kind == InputKind.USER_INPUT]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        dims = tuple(tuple(_expr(d) for d in t.shape) for t in tensors)
        ranges = tuple((expr, _bound(r.lower) or 0, _bound(r.upper))
                       for expr, r in program.range_constraints.items())
        at = tuple(tuple(d if isinstance(d, int) else -1 for d in shape) for shape in dims)
        return InputSizes(tuple(labels), dims, ranges, at)

    @property
    def fixed(self) -> bool:
        """Whether every dim of every input is fixed (a static capture)."""
        return all(isinstance(d, int) for shape in self.dims for d in shape)

    def why_not(self, sizes: Sizes) -> str | None:
        """``None`` if the graph serves a batch of ``sizes``, else the first reason why not."""
        if sizes not in self._verdicts:
            self._verdicts[sizes] = self._check(sizes)
        return self._verdicts[sizes]

    def _check(self, sizes: Sizes) -> str | None:
        import sympy

        if len(sizes) != len(self.dims):
            return f"{len(sizes)} tensor inputs, captured with {len(self.dims)}"
        symbols: dict[Any, int] = {}
        names: dict[Any, Any] = {}
        for label, shape, dims in zip(self.labels, sizes, self.dims):
            if len(shape) != len(dims):
                return f"{label} has {len(shape)} dims, captured with {len(dims)}"
            for d, (size, dim) in enumerate(zip(shape, dims)):
                if isinstance(dim, int):
                    if size != dim:
                        return f"{label} dim {d} is {size}, captured fixed at {dim}"
                elif isinstance(dim, sympy.Symbol):
                    names.setdefault(dim, sympy.Symbol(f"{label} dim {d}"))
                    if symbols.setdefault(dim, size) != size:
                        return f"{label} dim {d} is {size}, captured equal to a dim of size " \
                               f"{symbols[dim]}"
        for label, shape, dims in zip(self.labels, sizes, self.dims):
            for d, (size, dim) in enumerate(zip(shape, dims)):
                if not isinstance(dim, (int, sympy.Symbol)):
                    value = dim.subs(symbols)
                    if not isinstance(value, sympy.Integer) or int(value) != size:
                        return f"{label} dim {d} is {size}, captured as {dim}"
        for expr, low, high in self.ranges:
            value = expr.subs(symbols) if not isinstance(expr, int) else expr
            if not isinstance(value, (int, sympy.Integer)):
                return f"the size {expr} is not determined by the inputs"
            if int(value) < low or (high is not None and int(value) > high):
                span = f"{low} to {high}" if high is not None else f"{low} or more"
                shown = expr.subs(names) if not isinstance(expr, int) else expr
                return f"{shown} is {int(value)}, the graph serves {span}"
        return None
