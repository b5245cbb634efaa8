"""Nested values: flatten tuples, lists, dicts and namedtuples of tensors, and rebuild them.

What crosses a stage boundary, a micro-batch and a model output may all be nested. This
module turns such a value into a flat list of leaves plus a :class:`Structure` that
rebuilds it, so the runtime and the transports deal with flat lists only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Structure", "describe_value", "flatten", "iter_tensors", "map_tensors", "unflatten"]


@dataclass(frozen=True)
class Structure:
    """How to rebuild a nested value from its leaves (the result of :func:`flatten`).

    ``kind`` is ``"leaf"``, ``"tuple"``, ``"list"``, ``"dict"`` or ``"namedtuple"``;
    ``keys`` holds the dict keys (or the namedtuple type); ``children`` the sub-structures.
    Two values with equal structures differ only in their leaves.
    """

    kind: str
    children: tuple[Structure, ...] = ()
    keys: Any = None

    @property
    def num_leaves(self) -> int:
        """How many leaves the structure holds."""
        if self.kind == "leaf":
            return 1
        return sum(child.num_leaves for child in self.children)


_LEAF = Structure("leaf")


def flatten(value: Any) -> tuple[list[Any], Structure]:
    """Split ``value`` into its leaves (depth first) and its structure.

    Tuples, lists, dicts (keys in insertion order; subclasses such as ``OrderedDict``
    keep their type) and namedtuples are containers; everything else, tensors included,
    is a leaf.

    Example:
        >>> leaves, structure = flatten({"x": torch.zeros(2), "n": (3, [4])})
        >>> len(leaves)
        3
        >>> unflatten(leaves, structure)["n"]
        (3, [4])
    """
    leaves: list[Any] = []
    structure = _flatten_into(value, leaves)
    return leaves, structure


def _flatten_into(value: Any, leaves: list[Any]) -> Structure:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _LEAF
    if isinstance(value, tuple):
        children = tuple(_flatten_into(v, leaves) for v in value)
        if hasattr(value, "_fields"):
            return Structure("namedtuple", children, type(value))
        return Structure("tuple", children)
    if isinstance(value, list):
        return Structure("list", tuple(_flatten_into(v, leaves) for v in value))
    if isinstance(value, dict):
        keys = tuple(value.keys())
        children = tuple(_flatten_into(value[k], leaves) for k in keys)
        return Structure("dict", children, keys if type(value) is dict else (type(value), keys))
    leaves.append(value)
    return _LEAF


def unflatten(leaves: list[Any], structure: Structure) -> Any:
    """Rebuild the nested value that :func:`flatten` split into ``leaves`` and ``structure``.

    Example:
        >>> unflatten([1, 2], flatten((0, [0]))[1])
        (1, [2])
    """
    iterator = iter(leaves)
    value = _unflatten_from(iterator, structure)
    if next(iterator, _END) is not _END:
        raise ValueError(f"{len(leaves)} leaves given but the structure holds {structure.num_leaves}")
    return value


_END = object()


def _unflatten_from(leaves: Iterator[Any], structure: Structure) -> Any:
    kind = structure.kind
    if kind == "leaf":
        value = next(leaves, _END)
        if value is _END:
            raise ValueError("too few leaves for the structure")
        return value
    children = [_unflatten_from(leaves, child) for child in structure.children]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        if isinstance(structure.keys, tuple) and len(structure.keys) == 2 and isinstance(structure.keys[0], type):
            mapping_type, keys = structure.keys
            try:
                return mapping_type(zip(keys, children))
            except TypeError:  # e.g. defaultdict: its first argument is a factory
                return dict(zip(keys, children))
        return dict(zip(structure.keys, children))
    return structure.keys(*children)  # namedtuple


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nested value, depth first.

    Example:
        >>> [t.shape for t in iter_tensors((torch.zeros(1), "x", {"y": torch.zeros(2)}))]
        [torch.Size([1]), torch.Size([2])]
    """
    leaves, _ = flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """The nested value with ``fn`` applied to every tensor leaf.

    Example:
        >>> map_tensors(lambda t: t + 1, (torch.zeros(1), "x"))[0]
        tensor([1.])
    """
    leaves, structure = flatten(value)
    return unflatten([fn(v) if isinstance(v, torch.Tensor) else v for v in leaves], structure)


def describe_value(value: Any) -> str:
    """A short description of a nested value's tensors, e.g. ``(3, 32) float32``.

    Example:
        >>> describe_value({"x": torch.zeros(3, 32), "n": 1})
        "{'x': (3, 32) float32, 'n': int}"
    """
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe_value(v)}" for k, v in value.items()) + "}"
    return type(value).__name__
