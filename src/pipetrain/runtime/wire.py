"""The wire format: a nested value of tensors packed into one byte buffer and back.

A message is one contiguous ``uint8`` tensor::

    [ prefix (32 bytes) | metadata | pad | tensor 0 | pad | tensor 1 | ... ]

The prefix holds a magic number, the message kind, the micro-batch index, the metadata
length and the total length, so a receiver that posted a larger buffer knows where the
message ends. The metadata describes each tensor (dtype, shape, offset, whether its
sender's copy required grad): as packed integers for the usual messages (a tensor, or a
flat tuple / list of tensors and ``None`` — activations and gradients), as a pickle of
the structure otherwise. Shapes travel with every message, so they may change from one
micro-batch or step to the next.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipetrain.nested import flatten, unflatten

__all__ = [
    "KIND_DATA",
    "KIND_LARGE",
    "PREFIX_BYTES",
    "Message",
    "pack",
    "pack_large_notice",
    "read_prefix",
    "unpack",
]

_MAGIC = 0x70697065  # "pipe"
KIND_DATA = 1
"""A value for a micro-batch."""
KIND_LARGE = 2
"""A notice: the value is in the next message of the channel's overflow tag, ``total`` bytes."""
_PREFIX = struct.Struct("<IIqQQ")  # magic, kind, micro-batch, metadata length, total length
PREFIX_BYTES = _PREFIX.size
_ALIGN = 64

# metadata forms
_SINGLE, _TUPLE, _LIST, _PICKLE = 1, 2, 3, 4
_ITEM = struct.Struct("<BBBBQ")  # present, dtype code, requires grad, ndim, offset
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class _TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    requires_grad: bool


@dataclass(frozen=True)
class Message:
    """A decoded message: its kind, micro-batch index, value and total length in bytes."""

    kind: int
    microbatch: int
    value: Any
    total: int


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _flat(value: Any) -> tuple[int, list[torch.Tensor | None]] | None:
    """The fast form of ``value``, if it has one."""
    if isinstance(value, torch.Tensor):
        return _SINGLE, [value]
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        if all(v is None or (isinstance(v, torch.Tensor) and v.dtype in _CODE) for v in value):
            return (_TUPLE if isinstance(value, tuple) else _LIST), list(value)
    return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def pack(value: Any, *, microbatch: int, device: torch.device | None = None) -> torch.Tensor:
    """Pack ``value`` (a nested value of tensors and picklable leaves) into one buffer.

    Tensors keep their dtype and shape; ``requires_grad`` is recorded (the receiver uses
    it to decide which inputs get gradients). The buffer lives on ``device`` (default: the
    device of the first tensor, or the CPU).

    Example:
        >>> buf = pack({"x": torch.ones(2, 3), "n": 4}, microbatch=7)
        >>> msg = unpack(buf)
        >>> msg.microbatch, msg.value["x"].shape, msg.value["n"]
        (7, torch.Size([2, 3]), 4)
        >>> unpack(pack([torch.zeros(2), None], microbatch=0)).value
        [tensor([0., 0.]), None]
    """
    flat = _flat(value)
    tensors: list[torch.Tensor] = []
    offset = 0
    if flat is not None and (flat[0] != _SINGLE or flat[1][0].dtype in _CODE):  # type: ignore[union-attr]
        form, items = flat
        parts = [struct.pack("<BI", form, len(items))]
        for item in items:
            if item is None:
                parts.append(_ITEM.pack(0, 0, 0, 0, 0))
                continue
            parts.append(_ITEM.pack(1, _CODE[item.dtype], item.requires_grad, item.dim(), offset))
            parts.append(struct.pack(f"<{item.dim()}q", *item.shape))
            tensors.append(item)
            offset = _align(offset + _nbytes(item))
        meta = b"".join(parts)
    else:
        leaves, structure = flatten(value)
        descriptors: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                descriptors.append(_TensorMeta(leaf.dtype, tuple(leaf.shape), offset, leaf.requires_grad))
                tensors.append(leaf)
                offset = _align(offset + _nbytes(leaf))
            else:
                descriptors.append(leaf)
        meta = bytes([_PICKLE]) + pickle.dumps((structure, descriptors), protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(PREFIX_BYTES + len(meta))
    total = data_start + offset
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    head = _PREFIX.pack(_MAGIC, KIND_DATA, microbatch, len(meta), total) + meta
    buffer = torch.empty(total, dtype=torch.uint8)
    array = buffer.numpy()
    array[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    position = data_start
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        if nbytes:
            buffer[position : position + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        position = _align(position + nbytes)
    return buffer if device.type == "cpu" else buffer.to(device)


def pack_large_notice(*, microbatch: int, total: int) -> torch.Tensor:
    """The prefix-only notice sent instead of a message too large for the receiver's buffer."""
    buffer = torch.zeros(PREFIX_BYTES, dtype=torch.uint8)
    buffer.numpy()[:] = np.frombuffer(_PREFIX.pack(_MAGIC, KIND_LARGE, microbatch, 0, total), dtype=np.uint8)
    return buffer


def read_prefix(buffer: torch.Tensor) -> tuple[int, int, int, int]:
    """``(kind, micro-batch, metadata length, total length)``; checks the magic number."""
    array = buffer[:PREFIX_BYTES].cpu().numpy()
    magic, kind, microbatch, meta_len, total = _PREFIX.unpack_from(array.tobytes())
    if magic != _MAGIC:
        raise RuntimeError(
            f"corrupt pipeline message (magic {magic:#x}, expected {_MAGIC:#x}): "
            "the peers disagree on the message order of a channel"
        )
    return kind, microbatch, meta_len, total


def unpack(buffer: torch.Tensor) -> Message:
    """Decode a buffer made by :func:`pack` (or a notice).

    Tensors come back as views into ``buffer`` (no copy), each a leaf that requires grad
    exactly when the sender's tensor did.
    """
    kind, microbatch, meta_len, total = read_prefix(buffer)
    if kind != KIND_DATA:
        return Message(kind, microbatch, None, total)
    array = buffer.numpy() if buffer.device.type == "cpu" else buffer[: PREFIX_BYTES + meta_len].cpu().numpy()
    meta = array[PREFIX_BYTES : PREFIX_BYTES + meta_len].tobytes()
    data_start = _align(PREFIX_BYTES + meta_len)
    form = int(meta[0])

    def view(dtype: torch.dtype, shape: tuple[int, ...], offset: int, requires_grad: bool) -> torch.Tensor:
        start = data_start + offset
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * torch.empty((), dtype=dtype).element_size() if numel else 0
        tensor = buffer[start : start + nbytes].view(dtype).view(shape)
        return tensor.requires_grad_(requires_grad)

    if form == _PICKLE:
        structure, descriptors = pickle.loads(meta[1:])
        leaves = [
            view(d.dtype, d.shape, d.offset, d.requires_grad) if isinstance(d, _TensorMeta) else d
            for d in descriptors
        ]
        return Message(KIND_DATA, microbatch, unflatten(leaves, structure), total)
    (count,) = struct.unpack_from("<I", meta, 1)
    position = 5
    items: list[torch.Tensor | None] = []
    for _ in range(count):
        present, code, requires_grad, ndim, offset = _ITEM.unpack_from(meta, position)
        position += _ITEM.size
        if not present:
            items.append(None)
            continue
        shape = struct.unpack_from(f"<{ndim}q", meta, position)
        position += 8 * ndim
        items.append(view(_DTYPES[code], shape, offset, bool(requires_grad)))
    value: Any = items[0] if form == _SINGLE else (tuple(items) if form == _TUPLE else items)
    return Message(KIND_DATA, microbatch, value, total)
