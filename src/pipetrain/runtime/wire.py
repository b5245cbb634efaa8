"""The wire format: a nested value of tensors packed into one byte buffer and back.

A message is one contiguous ``uint8`` tensor::

    [ prefix: 4 x int64 | metadata (pickle) | pad | tensor 0 | pad | tensor 1 | ... ]

The prefix holds a magic number, the message kind, the metadata length and the total
length, so a receiver that posted a larger buffer knows where the message ends. The
metadata holds the value's structure, the non-tensor leaves, each tensor's dtype, shape,
offset and whether it carries a gradient, and the micro-batch index. Shapes travel with
every message, so they may change from one micro-batch or step to the next.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.nested import Structure, flatten, unflatten

__all__ = [
    "KIND_CLOSE",
    "KIND_DATA",
    "KIND_GROW",
    "PREFIX_BYTES",
    "Message",
    "pack",
    "pack_control",
    "read_prefix",
    "unpack",
]

_MAGIC = 0x70697065  # "pipe"
KIND_DATA = 1
"""A value for a micro-batch."""
KIND_GROW = 2
"""The next message is larger than the receiver's buffer: ``total`` is the new capacity."""
KIND_CLOSE = 3
"""The sender closes the channel; nothing follows."""
PREFIX_BYTES = 32
_ALIGN = 64


@dataclass(frozen=True)
class _TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    requires_grad: bool


@dataclass(frozen=True)
class Message:
    """A decoded message: the value, its micro-batch index, and its kind."""

    kind: int
    microbatch: int
    value: Any
    total: int


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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
    """
    leaves, structure = flatten(value)
    tensors: list[torch.Tensor] = []
    descriptors: list[Any] = []
    offset = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            descriptors.append(
                _TensorMeta(leaf.dtype, tuple(leaf.shape), offset, leaf.requires_grad)
            )
            tensors.append(leaf)
            offset = _align(offset + leaf.numel() * leaf.element_size())
        else:
            descriptors.append(leaf)
    meta = pickle.dumps((microbatch, structure, descriptors), protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(PREFIX_BYTES + len(meta))
    total = data_start + offset
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    header = torch.frombuffer(bytearray(PREFIX_BYTES + len(meta)), dtype=torch.uint8)
    header[:PREFIX_BYTES].view(torch.int64).copy_(
        torch.tensor([_MAGIC, KIND_DATA, len(meta), total], dtype=torch.int64)
    )
    header[PREFIX_BYTES:] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    buffer[: header.numel()].copy_(header)
    for tensor, descriptor in zip(tensors, (d for d in descriptors if isinstance(d, _TensorMeta))):
        start = data_start + descriptor.offset
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            target = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor.detach())
    return buffer


def pack_control(kind: int, *, total: int = 0) -> torch.Tensor:
    """A prefix-only message (``KIND_GROW`` with the new capacity, or ``KIND_CLOSE``)."""
    buffer = torch.zeros(PREFIX_BYTES, dtype=torch.uint8)
    buffer.view(torch.int64).copy_(torch.tensor([_MAGIC, kind, 0, total], dtype=torch.int64))
    return buffer


def read_prefix(buffer: torch.Tensor) -> tuple[int, int, int]:
    """``(kind, metadata length, total length)`` of a message; checks the magic number."""
    prefix = buffer[:PREFIX_BYTES].cpu().view(torch.int64).tolist()
    magic, kind, meta_len, total = prefix
    if magic != _MAGIC:
        raise RuntimeError(
            f"corrupt pipeline message (magic {magic:#x}, expected {_MAGIC:#x}): "
            "the peers disagree on the message order of a channel"
        )
    return int(kind), int(meta_len), int(total)


def unpack(buffer: torch.Tensor) -> Message:
    """Decode a buffer made by :func:`pack` (or :func:`pack_control`).

    Tensors come back as views into ``buffer`` (no copy), each a leaf that requires grad
    exactly when the sender's tensor did.
    """
    kind, meta_len, total = read_prefix(buffer)
    if kind != KIND_DATA:
        return Message(kind, -1, None, total)
    meta_bytes = buffer[PREFIX_BYTES : PREFIX_BYTES + meta_len].cpu().numpy().tobytes()
    microbatch, structure, descriptors = pickle.loads(meta_bytes)
    assert isinstance(structure, Structure)
    data_start = _align(PREFIX_BYTES + meta_len)
    leaves: list[Any] = []
    for descriptor in descriptors:
        if isinstance(descriptor, _TensorMeta):
            numel = 1
            for size in descriptor.shape:
                numel *= size
            nbytes = numel * torch.empty((), dtype=descriptor.dtype).element_size()
            start = data_start + descriptor.offset
            view = buffer[start : start + nbytes].view(descriptor.dtype).view(descriptor.shape)
            leaves.append(view.requires_grad_(descriptor.requires_grad))
        else:
            leaves.append(descriptor)
    return Message(KIND_DATA, microbatch, unflatten(leaves, structure), total)

