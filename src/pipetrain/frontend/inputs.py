"""The inputs of a captured model: naming them, their dynamic dims, and reading a batch.

A model is captured on example inputs given as positional ``args`` and keyword
``kwargs``; they are bound to the parameter names of ``model.forward`` so that a batch
may later be given in any of three forms (the same as the batch of
``Pipeline.train_step``): a tensor (the first parameter), a tuple (positional
arguments) or a dict (keyword arguments when its keys are names ``forward`` takes, e.g.
``{"input_ids", "position_ids"}`` for a Hugging Face model; else the first parameter, e.g.
the same dict given to an ``nn.Sequential`` whose first layer reads it). Every tensor of the bound inputs is a *slot*,
addressed by its path (``("input_ids",)``, ``("pair", 1)``); ``None`` holds no slot,
and other non-tensor values are constants of the capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.nested import describe_value

__all__ = ["InputBinding", "Path", "as_call", "bind_inputs", "dynamic_dims", "leaves_with_paths"]

Path = tuple[str | int, ...]
"""Where a leaf sits in the bound inputs: the parameter name, then keys / indices."""


def leaves_with_paths(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """The leaves of a nested value (tuples, lists, dicts) with their paths, in the order
    torch.export flattens them (``None`` is no leaf).

    Example:
        >>> [(p, v) for p, v in leaves_with_paths({"a": (1, None), "b": 2})]
        [(('a', 0), 1), (('b',), 2)]
    """
    if value is None:
        return
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from leaves_with_paths(item, (*path, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves_with_paths(item, (*path, key))
    else:
        yield path, value


def _show(path: Path) -> str:
    name, *rest = path
    return str(name) + "".join(f"[{key!r}]" for key in rest)


def _forward_signature(model: nn.Module) -> inspect.Signature:
    return inspect.signature(model.forward)


def _by_name(batch: dict[Any, Any], parameters: tuple[str, ...], any_keyword: bool) -> bool:
    """Whether a dict batch is keyword arguments (rather than the first input)."""
    return any_keyword or (bool(batch) and set(batch) <= set(parameters))


def _named_parameters(model: nn.Module) -> tuple[tuple[str, ...], bool]:
    """``forward``'s parameters that may be passed by name, and whether it takes ``**kwargs``."""
    signature = _forward_signature(model)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return (tuple(name for name, p in signature.parameters.items() if p.kind in kinds),
            any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()))


def as_call(model: nn.Module, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as the positional and keyword arguments of ``model`` (see the module
    docstring): what to capture the model on.

    Example:
        >>> batch = {"input_ids": torch.zeros(1, 2), "position_ids": torch.zeros(1, 2)}
        >>> as_call(nn.Sequential(nn.Identity()), batch)[1]
        {}
        >>> class LM(nn.Module):
        ...     def forward(self, input_ids, position_ids=None):
        ...         return input_ids
        >>> sorted(as_call(LM(), batch)[1])
        ['input_ids', 'position_ids']
    """
    if isinstance(batch, dict) and _by_name(batch, *_named_parameters(model)):
        return (), dict(batch)
    return (batch if isinstance(batch, tuple) else (batch,)), {}


def bind_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` and ``kwargs`` as keyword arguments of ``model.forward``, by name.

    Raises:
        TypeError: they do not fit the signature (the message shows it), or the model
            takes ``*args`` or positional-only parameters that are given.

    Example:
        >>> bind_inputs(nn.Linear(2, 2), (torch.zeros(1, 2),), {})["input"].shape
        torch.Size([1, 2])
    """
    signature = _forward_signature(model)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"example inputs do not match {type(model).__name__}.forward{signature}: {error}; "
            f"given {len(args)} positional ({describe_value(tuple(args))}) and keyword "
            f"arguments {sorted(kwargs)}; fix: pass example_inputs=(...) and "
            "example_kwargs={...} as you would call the model"
        ) from None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL or kind is inspect.Parameter.POSITIONAL_ONLY:
            if kind is inspect.Parameter.POSITIONAL_ONLY or value:
                raise TypeError(
                    f"{type(model).__name__}.forward{signature} takes its input {name!r} "
                    "positionally only; pipetrain passes inputs by name; fix: wrap the "
                    "model in a module whose forward names its parameters"
                )
        else:
            named[name] = value
    return named


@dataclass(frozen=True)
class InputBinding:
    """How a batch feeds the captured graph: the parameter names of ``forward`` and the
    paths of the tensor slots, in the order of the graph's inputs.

    Example:
        >>> binding = InputBinding.of(nn.Linear(2, 2), {"input": torch.zeros(3, 2)})
        >>> binding.slots
        (('input',),)
        >>> [t.shape for t in binding.read(torch.ones(5, 2))]
        [torch.Size([5, 2])]
    """

    model_name: str
    parameters: tuple[str, ...]
    """Names of ``forward``'s parameters that may be passed by name, in order."""
    slots: tuple[Path, ...]
    """Paths of the tensor inputs, in graph order."""
    examples: tuple[str, ...]
    """Each slot's example, as ``(2, 16) int64`` (for error messages)."""
    any_keyword: bool = False
    """``forward`` takes ``**kwargs``: every dict batch is keyword arguments."""

    @property
    def labels(self) -> tuple[str, ...]:
        """Each slot as the user would write it (``input_ids``, ``pair[1]``)."""
        return tuple(_show(path) for path in self.slots)

    @staticmethod
    def of(model: nn.Module, named: Mapping[str, Any]) -> InputBinding:
        """The binding of the inputs ``named`` (from :func:`bind_inputs`)."""
        parameters, any_keyword = _named_parameters(model)
        slots = [(path, leaf) for path, leaf in leaves_with_paths(dict(named))
                 if isinstance(leaf, torch.Tensor)]
        return InputBinding(type(model).__name__, parameters, tuple(p for p, _ in slots),
                            tuple(describe_value(leaf) for _, leaf in slots), any_keyword)

    def named(self, batch: Any) -> dict[str, Any]:
        """A batch (tensor, tuple of positional arguments, or dict) by parameter name."""
        if isinstance(batch, dict) and _by_name(batch, self.parameters, self.any_keyword):
            return dict(batch)
        values = batch if isinstance(batch, tuple) else (batch,)
        if len(values) > len(self.parameters):
            raise TypeError(
                f"{self.model_name} takes at most {len(self.parameters)} inputs "
                f"{list(self.parameters)} but the batch has {len(values)} positional ones; "
                "fix: pass a dict of keyword inputs"
            )
        return dict(zip(self.parameters, values))

    def read(self, batch: Any) -> list[torch.Tensor]:
        """The tensors of ``batch`` in graph order.

        Raises:
            ValueError: a tensor the model was captured with is missing or is not a
                tensor, or the batch has a tensor the capture did not see.
        """
        found = {path: leaf for path, leaf in leaves_with_paths(self.named(batch))}
        missing = [f"{_show(p)} (captured as {e})" for p, e in zip(self.slots, self.examples)
                   if not isinstance(found.get(p), torch.Tensor)]
        extra = [_show(p) for p, leaf in found.items()
                 if isinstance(leaf, torch.Tensor) and p not in self.slots]
        if missing or extra:
            problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"not in the capture: {', '.join(extra)}"] if extra else [])
            raise ValueError(
                f"the batch does not match the inputs {self.model_name} was captured with: "
                f"{'; '.join(problems)}; fix: pass the same inputs as example_inputs / "
                f"example_kwargs (a tensor, a tuple of positional inputs, or a dict by name), "
                f"e.g. {{{', '.join(repr(_show(p)) for p in self.slots)}: ...}}"
            )
        return [found[path] for path in self.slots]


def dynamic_dims(named: Mapping[str, Any]) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` for ``named``: every dim of every tensor is
    ``Dim.AUTO`` (export keeps dynamic what the model lets vary, e.g. batch and sequence),
    but dims of size 0 or 1, which export fixes anyway, are ``Dim.STATIC``."""
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: torch.export.Dim.AUTO if size > 1 else torch.export.Dim.STATIC
                    for d, size in enumerate(value.shape)}
        if isinstance(value, (tuple, list)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    return {name: spec(value) for name, value in named.items()}

