"""Capture: a model and example inputs -> one graph of ATen operations (torch.export, non-strict).

The model runs once under torch.export's non-strict tracer (its Python runs as written;
tensors are fake, so a model on the ``meta`` device is captured without allocating),
in training mode, with every dim of every input tensor marked ``Dim.AUTO``: dims the
model lets vary (batch, sequence length) stay symbolic, so one graph serves every
micro-batch size and sequence length. A model whose code pins a dim is captured with
it static; a model that cannot be captured with dynamic dims at all is captured with
static shapes (logged). Which input sizes the graph serves is recorded
(:class:`~pipetrain.frontend.sizes.InputSizes`); other sizes get their own capture.

Only the inputs that hold tensors go through torch.export, as keyword arguments of a
``forward`` that takes exactly them: the other inputs (``use_cache=False``, ``None``)
are bound around the model's own ``forward`` for the capture. torch.export (2.13) cannot
match ``dynamic_shapes`` to inputs that land in a ``**kwargs`` parameter (every Hugging
Face model's ``forward`` has one) and would otherwise fall back to static shapes.

The exported program is turned into a plain :class:`torch.fx.Graph`: parameters and
buffers become ``get_attr`` nodes under the model's own names (``transformer.h.0.attn.
c_attn.weight``), lifted constants ``get_attr`` nodes of :data:`CONSTANT_PREFIX`, the
tensor inputs placeholders (in :class:`~pipetrain.frontend.inputs.InputBinding` order),
and the output node returns the flat leaves of the model's output
(``out_spec.unflatten`` rebuilds it, a Hugging Face ``ModelOutput`` included).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from pipetrain.compat import export_meta_models_on_meta_inputs
from pipetrain.frontend.errors import CaptureError, explain_capture_error
from pipetrain.frontend.inputs import InputBinding, dynamic_dims, leaves_with_paths
from pipetrain.frontend.sizes import InputSizes
from pipetrain.nested import describe_value, map_tensors

__all__ = ["CONSTANT_PREFIX", "CapturedGraph", "capture"]

logger = logging.getLogger(__name__)

CONSTANT_PREFIX = "pipetrain_constant_"
"""Attribute names of the tensors the model creates from Python values (lifted constants)."""


@dataclass
class CapturedGraph:
    """A model as one graph: what the stages are cut from."""

    graph: fx.Graph
    binding: InputBinding
    out_spec: Any
    """torch.export's tree spec of the model's output (``out_spec.unflatten(leaves)``)."""
    sizes: InputSizes
    """The sizes of the tensor inputs that the graph serves."""
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """Lifted constants by attribute name."""
    dynamic: bool = True
    """Whether the input dims were captured dynamic (else every shape is fixed)."""


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in leaves_with_paths(value))


@contextmanager
def _tensor_inputs_only(model: nn.Module, names: list[str],
                        constants: dict[str, Any]) -> Iterator[None]:
    """``model.forward`` taking exactly the keyword inputs ``names``, with ``constants``
    bound, for as long as the context lasts (an attribute of the instance, then removed)."""
    original = model.forward
    saved = model.__dict__.get("forward")

    def forward(**inputs: Any) -> Any:
        return original(**constants, **inputs)

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in names])
    object.__setattr__(model, "forward", forward)
    try:
        yield
    finally:
        if saved is None:
            object.__delattr__(model, "forward")
        else:
            object.__setattr__(model, "forward", saved)


def _export(model: nn.Module, named: dict[str, Any], *, dynamic: bool) -> ExportedProgram:
    inputs = {name: value for name, value in named.items() if _holds_tensor(value)}
    if export_meta_models_on_meta_inputs() and any(
            t.is_meta for t in [*model.parameters(), *model.buffers()]):
        inputs = map_tensors(lambda t: t.to("meta"), inputs)  # older torch: see pipetrain.compat
    constants = {name: value for name, value in named.items() if name not in inputs}
    shapes = dynamic_dims(inputs) if dynamic else None
    with _tensor_inputs_only(model, list(inputs), constants):
        return torch.export.export(model, (), inputs, strict=False, dynamic_shapes=shapes)


def _examples(named: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}: {describe_value(value)}" for name, value in named.items()) or "none"


def _program(model: nn.Module, named: dict[str, Any]) -> tuple[ExportedProgram, bool]:
    """Export dynamic, else static; a failure of both is explained."""
    was_training = model.training
    model.train()
    try:
        try:
            return _export(model, named, dynamic=True), True
        except Exception as dynamic_error:
            logger.debug("capture with dynamic dims failed (%s); capturing static shapes",
                         str(dynamic_error).splitlines()[0][:200] if str(dynamic_error) else
                         type(dynamic_error).__name__)
            try:
                return _export(model, named, dynamic=False), False
            except Exception as error:
                raise explain_capture_error(model, error, examples=_examples(named)) from error
    finally:
        model.train(was_training)


def _unsupported(what: str, model: nn.Module) -> CaptureError:
    return CaptureError(
        f"cannot pipeline {type(model).__name__}: its graph {what}; fix: pass the model as "
        "a list of layers (nn.Sequential or layer factories)"
    )


def capture(model: nn.Module, named: dict[str, Any]) -> CapturedGraph:
    """Capture ``model`` called with the keyword inputs ``named`` (see the module docstring).

    Raises:
        CaptureError: the model cannot be captured (the message names the layer, the
            operation and the fix).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> captured = capture(model, {"input": torch.randn(3, 4)})
        >>> sorted(str(n.target) for n in captured.graph.nodes if n.op == "get_attr")
        ['0.bias', '0.weight']
    """
    program, dynamic = _program(model, named)
    binding = InputBinding.of(model, named)
    signature = program.graph_signature
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user_leaves = [leaf for name, value in named.items() if _holds_tensor(value)
                   for _, leaf in leaves_with_paths(value, (name,))]
    user_index = 0
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            new = graph.get_attr(str(spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            name = f"{CONSTANT_PREFIX}{len(constants)}"
            constants[name] = program.constants[str(spec.target)]
            new = graph.get_attr(name)
        elif spec.kind == InputKind.USER_INPUT:
            leaf = user_leaves[user_index]
            user_index += 1
            if isinstance(leaf, torch.Tensor):
                new = graph.placeholder(node.name)
            else:
                env[node] = leaf  # a constant of the capture (use_cache=False, ...)
                continue
        else:
            raise _unsupported(f"takes a {spec.kind.name.lower()} input", model)
        new.meta = dict(node.meta)
        env[node] = new
    outputs: list[Any] = []
    for node in program.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            for value, spec in zip(node.args[0], signature.output_specs):
                mapped = env[value] if isinstance(value, fx.Node) else value
                if spec.kind == OutputKind.USER_OUTPUT:
                    outputs.append(mapped)
                elif spec.kind == OutputKind.BUFFER_MUTATION:
                    target = graph.get_attr(str(spec.target))
                    detached = graph.call_function(torch.ops.aten.detach.default, (mapped,))
                    graph.call_function(torch.ops.aten.copy_.default, (target, detached))
                else:
                    raise _unsupported(f"has a {spec.kind.name.lower()} output", model)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(outputs))
    graph.lint()
    sizes = InputSizes.of(program, labels=binding.labels)
    return CapturedGraph(graph, binding, program.call_spec.out_spec, sizes, constants, dynamic)
