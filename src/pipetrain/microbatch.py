"""Micro-batches: splitting a nested mini-batch along dim 0 and merging it back.

A batch is a tensor, or a tuple / list / namedtuple / dict nesting tensors and other
values. Tensors with at least one dimension are *batch tensors*: they are split along
dim 0 and must all have the same size there. Every other leaf (``None``, numbers,
strings, 0-dim tensors) is *shared*: each micro-batch gets the same object, and merging
takes it from the first micro-batch.

Splitting follows :func:`torch.tensor_split`: sizes differ by at most one, larger
micro-batches first (10 rows in 4 -> 3, 3, 2, 2). A batch with fewer rows than
``num_chunks`` gives one micro-batch per row, never an empty one. The chunks are views
of the original tensors (no copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from pipetrain.nested import map_tensors

__all__ = ["batch_size", "map_tensors", "merge_batches", "split_batch"]


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(template: Any, items: list[Any]) -> Any:
    """A container of ``template``'s type holding ``items`` (values in the same order)."""
    if isinstance(template, dict):
        pairs = zip(template.keys(), items)
        if type(template) is dict:
            return dict(pairs)
        try:
            return type(template)(pairs)
        except TypeError:  # e.g. defaultdict: its first argument is a factory
            return dict(pairs)
    if _is_namedtuple(template):
        return type(template)(*items)
    if isinstance(template, tuple):
        return tuple(items)
    return list(items)


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` pairs of a container, or None for a leaf."""
    if isinstance(value, dict):
        return [(f"[{key!r}]", child) for key, child in value.items()]
    if _is_namedtuple(value):
        return [(f".{field}", child) for field, child in zip(value._fields, value)]
    if isinstance(value, (tuple, list)):
        return [(f"[{index}]", child) for index, child in enumerate(value)]
    return None


def _batch_tensors(value: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    """Every batch tensor (at least one dimension) in ``value``, with its path."""
    if isinstance(value, Tensor):
        if value.dim() > 0:
            yield path, value
        return
    children = _children(value)
    if children is not None:
        for suffix, child in children:
            yield from _batch_tensors(child, path + suffix)


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every batch tensor of a nested batch.

    Raises:
        ValueError: batch tensors disagree on dim 0 (the message names their paths and
            sizes), or the batch holds no tensor with a dimension to split along.

    Example:
        >>> import torch
        >>> batch_size({"x": torch.zeros(8, 3), "mask": torch.ones(8), "lr": 0.1})
        8
    """
    size: int | None = None
    first_path = ""
    first_shape: tuple[int, ...] = ()
    for path, tensor in _batch_tensors(batch, "batch"):
        if size is None:
            size, first_path, first_shape = tensor.size(0), path, tuple(tensor.shape)
        elif tensor.size(0) != size:
            raise ValueError(
                f"every tensor of a batch must have the same size in dim 0, but "
                f"{first_path} has {size} rows and {path} has {tensor.size(0)} "
                f"(shapes {first_shape} and "
                f"{tuple(tensor.shape)}); fix: pass per-sample tensors with the batch "
                f"dimension first, and values shared by all samples as Python values or "
                f"0-dim tensors"
            )
    if size is None:
        raise ValueError(
            f"the batch has no tensor with a batch dimension to split along dim 0 "
            f"(got {type(batch).__name__}: {_short_repr(batch)}); fix: pass a tensor, "
            f"or a tuple / list / dict holding tensors whose dim 0 is the batch"
        )
    return size


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split(value: Any, num_chunks: int) -> list[Any]:
    if isinstance(value, Tensor):
        if value.dim() > 0:
            return list(torch.tensor_split(value, num_chunks))
        return [value] * num_chunks
    children = _children(value)
    if children is None:
        return [value] * num_chunks
    columns = [_split(child, num_chunks) for _, child in children]
    return [_rebuild(value, [column[i] for column in columns]) for i in range(num_chunks)]


def split_batch(batch: Any, num_chunks: int) -> list[Any]:
    """Split a nested batch into at most ``num_chunks`` micro-batches along dim 0.

    Sizes follow :func:`torch.tensor_split` (10 rows in 4 -> 3, 3, 2, 2). A batch with
    fewer rows than ``num_chunks`` gives one micro-batch per row; an empty batch (0
    rows) gives itself as the only micro-batch. Shared leaves (non-tensors, 0-dim
    tensors) appear unchanged in every micro-batch.

    Raises:
        ValueError: ``num_chunks < 1``, or batch tensors disagree on dim 0.

    Example:
        >>> import torch
        >>> chunks = split_batch({"x": torch.arange(10), "scale": 2.0}, 4)
        >>> [len(c["x"]) for c in chunks], chunks[3]["scale"]
        ([3, 3, 2, 2], 2.0)
        >>> len(split_batch(torch.zeros(2, 5), 4))
        2
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(
            f"num_chunks must be a positive integer, got {num_chunks!r}; fix: "
            f"split_batch(batch, 4) for 4 micro-batches, or 1 for no split"
        )
    size = batch_size(batch)
    num_chunks = min(num_chunks, max(size, 1))
    if num_chunks == 1:
        return [batch]
    return _split(batch, num_chunks)


def _merge(chunks: Sequence[Any], path: str) -> Any:
    first = chunks[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            return first
        for index, chunk in enumerate(chunks):
            if not isinstance(chunk, Tensor) or chunk.dim() == 0:
                raise ValueError(
                    f"cannot merge micro-batches: {path} is a tensor of shape "
                    f"{tuple(first.shape)} in micro-batch 0 but "
                    f"{_short_repr(chunk)} in micro-batch {index}; fix: return the same "
                    f"structure from every micro-batch"
                )
        return torch.cat(list(chunks))
    children = _children(first)
    if children is None:
        return first
    for index, chunk in enumerate(chunks):
        other = _children(chunk)
        same_keys = other is not None and [s for s, _ in other] == [s for s, _ in children]
        if type(chunk) is not type(first) or not same_keys:
            raise ValueError(
                f"cannot merge micro-batches: {path} is {_short_repr(first)} in "
                f"micro-batch 0 but {_short_repr(chunk)} in micro-batch {index}; fix: "
                f"return the same structure (container types, keys, lengths) from every "
                f"micro-batch"
            )
    columns = [[child for _, child in _children(chunk) or ()] for chunk in chunks]
    merged = [
        _merge([column[k] for column in columns], path + suffix)
        for k, (suffix, _) in enumerate(children)
    ]
    return _rebuild(first, merged)


def merge_batches(chunks: Sequence[Any]) -> Any:
    """Concatenate micro-batches back into one batch: the inverse of :func:`split_batch`.

    Batch tensors are concatenated along dim 0; shared leaves (non-tensors, 0-dim
    tensors) are taken from the first micro-batch. One micro-batch is returned as is.

    Raises:
        ValueError: no micro-batches, or micro-batches with different structures (the
            message names the path).

    Example:
        >>> import torch
        >>> batch = {"x": torch.arange(10), "scale": 2.0}
        >>> merged = merge_batches(split_batch(batch, 4))
        >>> torch.equal(merged["x"], batch["x"]), merged["scale"]
        (True, 2.0)
    """
    if len(chunks) == 0:
        raise ValueError(
            "merge_batches needs at least one micro-batch, got an empty sequence; fix: "
            "pass the list returned by split_batch (or the stage outputs, one per "
            "micro-batch)"
        )
    if len(chunks) == 1:
        return chunks[0]
    return _merge(chunks, "batch")
