"""Why a model could not be captured, told as the layer and operation that failed and the fix.

torch.export reports a failure from deep inside its tracer. What a user needs is the
module of *their* model that ran the failing line, the line itself, and what to change:
:func:`explain_capture_error` walks the traceback for the innermost frame whose ``self``
is a submodule of the model and builds a :class:`CaptureError` from it.
"""

from __future__ import annotations

import linecache
import traceback
from dataclasses import dataclass

from torch import nn

__all__ = ["CaptureError", "explain_capture_error", "failing_layer"]

_DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependentSymNode",
                   "Could not guard on", "Could not extract specialized integer")
_LAYER_LIST = ("pass the model as a list of layers (an nn.Sequential or layer factories: "
               "Pipeline(nn.Sequential(...)) / GPipe(nn.Sequential(...), balance)), whose "
               "layers run their Python as written")


class CaptureError(ValueError):
    """The model could not be captured into a graph (the message names the layer, the
    operation and the fix)."""


@dataclass(frozen=True)
class Where:
    """The innermost module of the model on the failing call path, and its line."""

    name: str
    """Qualified name in the model (``""`` for the model itself)."""
    type_name: str
    location: str
    """``file:line``."""
    code: str
    """The source line."""

    def describe(self) -> str:
        label = f"layer {self.name!r}" if self.name else "the model's own forward"
        return f"{label} ({self.type_name}) at {self.location}: `{self.code}`"


def failing_layer(model: nn.Module, error: BaseException) -> Where | None:
    """The innermost submodule of ``model`` whose ``forward`` (or a method) was running
    when ``error`` was raised, or ``None`` if none was.

    Example:
        >>> class Bad(nn.Module):
        ...     def forward(self, x):
        ...         raise RuntimeError("boom")
        >>> model = nn.Sequential(nn.Identity(), Bad())
        >>> try:
        ...     model(1)
        ... except RuntimeError as error:
        ...     failing_layer(model, error).name
        '1'
    """
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    found: Where | None = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            filename = frame.f_code.co_filename
            found = Where(names[id(owner)], type(owner).__name__, f"{filename}:{lineno}",
                          linecache.getline(filename, lineno).strip())
    return found


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def explain_capture_error(model: nn.Module, error: BaseException, *,
                          examples: str) -> CaptureError:
    """A :class:`CaptureError` telling which layer of ``model`` failed how, and the fix.

    ``examples`` describes the example inputs (shapes and dtypes).

    Example:
        >>> class Gate(nn.Module):
        ...     def forward(self, x):
        ...         raise RuntimeError("Could not guard on data-dependent expression u0 > 0")
        >>> model = nn.Sequential(Gate())
        >>> try:
        ...     model(0)
        ... except RuntimeError as error:
        ...     message = str(explain_capture_error(model, error, examples="x: (2, 3) float32"))
        >>> "layer '0' (Gate)" in message and "torch.where" in message
        True
    """
    where = failing_layer(model, error)
    place = where.describe() if where is not None else f"{type(model).__name__}'s forward"
    detail = _first_line(error)
    text = str(error)
    if any(marker in text for marker in _DATA_DEPENDENT):
        return CaptureError(
            f"cannot capture {type(model).__name__}: {place} branches on the value of a "
            f"tensor (data-dependent control flow, which one graph cannot hold: {detail}); "
            f"fix: compute both sides and pick with torch.where (or use torch.cond), or "
            f"{_LAYER_LIST}; split points do not help, the whole model is captured first"
        )
    if isinstance(error, (RuntimeError, IndexError, TypeError, ValueError, AssertionError)):
        return CaptureError(
            f"cannot capture {type(model).__name__} on the example inputs ({examples}): "
            f"{place} failed with {type(error).__name__}: {detail}; fix: pass "
            "example_inputs / example_kwargs that the model itself accepts (call "
            "model(*example_inputs, **example_kwargs) once to check; a batch of 2 or more "
            f"samples), or, if it runs eagerly but not in the graph, {_LAYER_LIST}"
        )
    return CaptureError(
        f"cannot capture {type(model).__name__}: {place} raised "
        f"{type(error).__name__}: {detail}; fix: {_LAYER_LIST}"
    )
