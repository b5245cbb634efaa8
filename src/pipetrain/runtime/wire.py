"""The wire format: a message's header (its metadata, small host tensors inline) and the
tensors that travel apart from it.

A message is a *header*, one contiguous CPU ``uint8`` tensor::

    [ prefix (40 bytes) | metadata | pad | inline tensor 0 | pad | inline tensor 1 | ... ]

and, after it, the message's other tensors, each sent apart as its own bytes on its own
device (no host staging). The prefix holds a magic number, the message kind, the
channel's tag, the micro-batch index, the metadata length and the header's length (a
receiver that posted a larger buffer knows where the header ends). The metadata
describes each tensor: dtype, shape, whether the sender's copy required grad, and its
*route*:

* ``INLINE``: in the header, at an offset (host tensors, while the header stays under
  the sender's ``inline_limit``);
* ``DEVICE``: apart, through the link's data group, into a buffer on the receiver's
  device (device tensors on the job's backend; host tensors too when that backend is
  gloo);
* ``HOST``: apart, through the header's group, into a host buffer (host tensors of a job
  whose data backend takes device tensors only, e.g. NCCL).

The metadata is packed integers for the usual messages (a tensor, or a flat tuple / list
of tensors and ``None``: activations and gradients) and a pickle of the structure
otherwise. Shapes travel with every message, so they may change from one micro-batch or
step to the next.
"""

from __future__ import annotations

import functools
import math
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.nested import flatten, unflatten

__all__ = [
    "DEVICE",
    "HOST",
    "INLINE",
    "KIND_DATA",
    "KIND_LARGE",
    "PREFIX_BYTES",
    "Apart",
    "Encoded",
    "Header",
    "decode",
    "encode",
    "encode_notice",
]

_MAGIC = 0x70697065  # "pipe"
KIND_DATA = 1
"""A message's header."""
KIND_LARGE = 2
"""A notice: the header is too large for the receiver's buffer and follows on the
overflow tag, ``total`` bytes long."""
INLINE, DEVICE, HOST = 0, 1, 2
"""The routes of a tensor (see the module docstring)."""
_PREFIX = struct.Struct("<IIiIqQQ")  # magic, kind, tag, unused, micro-batch, metadata length, total
PREFIX_BYTES = _PREFIX.size
_ALIGN = 64

# metadata forms
_SINGLE, _TUPLE, _LIST, _PICKLE = 1, 2, 3, 4
_ITEM = struct.Struct("<BBBBBQ")  # present, dtype code, requires grad, ndim, route, offset
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class _TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    route: int
    offset: int
    requires_grad: bool


@dataclass(frozen=True)
class Apart:
    """A tensor that travels apart from its header: its route and what to allocate."""

    route: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Encoded:
    """A message ready to send: its header and its apart tensors as ``(route, bytes)``."""

    header: torch.Tensor
    apart: list[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class Header:
    """A decoded header: the message's kind, channel tag and micro-batch, the header's
    length, the tensors still to receive, and :meth:`value` to assemble the value."""

    kind: int
    tag: int
    microbatch: int
    total: int
    apart: list[Apart]
    _build: Callable[[Sequence[torch.Tensor]], Any]

    def value(self, received: Sequence[torch.Tensor] = ()) -> Any:
        """The message's value, given the byte buffers of :attr:`apart` in order."""
        if len(received) != len(self.apart):
            raise RuntimeError(f"a message needs {len(self.apart)} apart tensors, got {len(received)}")
        return self._build(received)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@functools.cache
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * _element_size(dtype)


def _flat(value: Any) -> tuple[int, list[torch.Tensor | None]] | None:
    """The fast form of ``value``, if it has one."""
    if isinstance(value, torch.Tensor):
        return (_SINGLE, [value]) if value.dtype in _CODE else None
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        if all(v is None or (isinstance(v, torch.Tensor) and v.dtype in _CODE) for v in value):
            return (_TUPLE if isinstance(value, tuple) else _LIST), list(value)
    return None


def _as_bytes(tensor: torch.Tensor, *, to_host: bool) -> torch.Tensor:
    """The bytes of ``tensor`` as a flat ``uint8`` tensor (on the host if ``to_host``)."""
    tensor = tensor.detach()
    if to_host:
        tensor = tensor.cpu()
    return tensor.reshape(-1).view(torch.uint8)


class _Router:
    """Chooses each tensor's route and lays out the inline section."""

    def __init__(self, device_type: str, inline_limit: int) -> None:
        self.device_type = device_type
        self.inline_left = inline_limit
        self.offset = 0
        self.inline: list[tuple[int, torch.Tensor]] = []
        self.apart: list[tuple[int, torch.Tensor]] = []

    def place(self, tensor: torch.Tensor) -> tuple[int, int]:
        """``(route, offset)`` of ``tensor`` (offset: into the inline section)."""
        nbytes = tensor.numel() * tensor.element_size()
        on_device = tensor.device.type != "cpu" and tensor.device.type == self.device_type
        if not on_device and nbytes <= self.inline_left:
            offset = _align(self.offset)
            self.inline.append((offset, tensor))
            self.offset = offset + nbytes
            self.inline_left -= nbytes
            return INLINE, offset
        route = DEVICE if on_device or self.device_type == "cpu" else HOST
        self.apart.append((route, _as_bytes(tensor, to_host=not on_device)))
        return route, 0


def _meta(value: Any, router: _Router) -> bytes:
    """The metadata of ``value``, its tensors placed by ``router``."""
    flat = _flat(value)
    if flat is not None:
        form, items = flat
        parts = [struct.pack("<BI", form, len(items))]
        for item in items:
            if item is None:
                parts.append(_ITEM.pack(0, 0, 0, 0, 0, 0))
                continue
            route, offset = router.place(item)
            parts.append(_ITEM.pack(1, _CODE[item.dtype], item.requires_grad, item.dim(), route, offset))
            parts.append(struct.pack(f"<{item.dim()}q", *item.shape))
        return b"".join(parts)
    leaves, structure = flatten(value)
    descriptors: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            route, offset = router.place(leaf)
            descriptors.append(_TensorMeta(leaf.dtype, tuple(leaf.shape), route, offset, leaf.requires_grad))
        else:
            descriptors.append(leaf)
    return bytes([_PICKLE]) + pickle.dumps((structure, descriptors), protocol=pickle.HIGHEST_PROTOCOL)


def encode(value: Any, *, tag: int, microbatch: int, device_type: str = "cpu",
           inline_limit: int = 1 << 20) -> Encoded:
    """Encode ``value`` (a nested value of tensors and picklable leaves) for channel ``tag``.

    Host tensors go inline while their bytes add up to at most ``inline_limit``; device
    tensors of type ``device_type`` (the data backend's device) always travel apart.
    The header is assembled by one ``torch.cat`` (each torch call between two compute
    actions runs with cold caches: a message's cost is its number of calls).

    Example:
        >>> enc = encode({"x": torch.ones(2, 3), "n": 4}, tag=1, microbatch=7)
        >>> head = decode(enc.header)
        >>> head.microbatch, head.value()["x"].shape, head.value()["n"], enc.apart
        (7, torch.Size([2, 3]), 4, [])
        >>> enc = encode([torch.arange(3), None], tag=1, microbatch=0, inline_limit=0)
        >>> head = decode(enc.header)
        >>> [a.route for a in head.apart], head.value([b for _, b in enc.apart])
        ([1], [tensor([0, 1, 2]), None])
    """
    router = _Router(device_type, inline_limit)
    meta = _meta(value, router)
    data_start = _align(PREFIX_BYTES + len(meta))
    total = data_start + router.offset
    head = bytearray(_PREFIX.pack(_MAGIC, KIND_DATA, tag, 0, microbatch, len(meta), total))
    head += meta
    head += bytes(data_start - len(head))
    parts = [torch.frombuffer(head, dtype=torch.uint8)]
    position = 0
    for offset, tensor in router.inline:
        if offset > position:
            parts.append(_ZEROS[: offset - position])
        parts.append(_as_bytes(tensor, to_host=False))
        position = offset + tensor.numel() * tensor.element_size()
    return Encoded(torch.cat(parts) if len(parts) > 1 else parts[0], router.apart)


_ZEROS = torch.zeros(_ALIGN, dtype=torch.uint8)
"""Padding between inline tensors."""


def encode_notice(*, tag: int, microbatch: int, total: int) -> torch.Tensor:
    """The prefix-only notice sent instead of a header too large for the receiver's buffer."""
    prefix = bytearray(_PREFIX.pack(_MAGIC, KIND_LARGE, tag, 0, microbatch, 0, total))
    return torch.frombuffer(prefix, dtype=torch.uint8)


def _read_prefix(raw: memoryview) -> tuple[int, int, int, int, int]:
    magic, kind, tag, _, microbatch, meta_len, total = _PREFIX.unpack_from(raw)
    if magic != _MAGIC:
        raise RuntimeError(
            f"corrupt pipeline message (magic {magic:#x}, expected {_MAGIC:#x}): "
            "the peers disagree on the message order of a link"
        )
    return kind, tag, microbatch, meta_len, total


def decode(buffer: torch.Tensor, *, capacity: int | None = None) -> Header:
    """Decode a header made by :func:`encode` (or a notice) from a CPU ``uint8`` buffer.

    Inline tensors come back as views into ``buffer`` (no copy), or as copies when the
    header fills less than a quarter of ``capacity`` (the size of the buffer it was
    received into: the values then do not keep the whole buffer alive). Every tensor is a
    leaf that requires grad exactly when the sender's tensor did.
    """
    raw = buffer.numpy().data
    kind, tag, microbatch, meta_len, total = _read_prefix(raw)
    if kind != KIND_DATA:
        return Header(kind, tag, microbatch, total, [], lambda received: None)
    copy = capacity is not None and total * 4 < capacity
    data_start = _align(PREFIX_BYTES + meta_len)
    apart: list[Apart] = []
    slots: list[Any] = []  # a tensor, an index into the apart tensors, or a plain leaf

    def tensor(dtype: torch.dtype, shape: tuple[int, ...], route: int, offset: int, grad: bool) -> None:
        if route != INLINE:
            slots.append((len(apart), grad))
            apart.append(Apart(route, dtype, shape, _nbytes(dtype, shape)))
            return
        count = math.prod(shape)
        if count:
            value = torch.frombuffer(raw, dtype=dtype, count=count, offset=data_start + offset)
            if copy:
                value = value.clone()
        else:
            value = torch.empty(0, dtype=dtype)
        if value.shape != shape:
            value = value.view(shape)
        slots.append(value.requires_grad_() if grad else value)

    form = int(raw[PREFIX_BYTES])
    structure = None
    if form == _PICKLE:
        structure, descriptors = pickle.loads(raw[PREFIX_BYTES + 1 : PREFIX_BYTES + meta_len].tobytes())
        for d in descriptors:
            if isinstance(d, _TensorMeta):
                tensor(d.dtype, d.shape, d.route, d.offset, d.requires_grad)
            else:
                slots.append(_Leaf(d))
    else:
        (count,) = struct.unpack_from("<I", raw, PREFIX_BYTES + 1)
        position = PREFIX_BYTES + 5
        for _ in range(count):
            present, code, grad, ndim, route, offset = _ITEM.unpack_from(raw, position)
            position += _ITEM.size
            if not present:
                slots.append(_Leaf(None))
                continue
            shape = struct.unpack_from(f"<{ndim}q", raw, position)
            position += 8 * ndim
            tensor(_DTYPES[code], tuple(shape), route, offset, bool(grad))

    def build(received: Sequence[torch.Tensor]) -> Any:
        leaves = [_fill(slot, received, apart) for slot in slots]
        if structure is not None:
            return unflatten(leaves, structure)
        return leaves[0] if form == _SINGLE else (tuple(leaves) if form == _TUPLE else leaves)

    return Header(kind, tag, microbatch, total, apart, build)


@dataclass(frozen=True)
class _Leaf:
    value: Any


def _fill(slot: Any, received: Sequence[torch.Tensor], apart: list[Apart]) -> Any:
    if isinstance(slot, _Leaf):
        return slot.value
    if isinstance(slot, torch.Tensor):
        return slot
    index, grad = slot
    spec = apart[index]
    value = received[index].view(spec.dtype).view(spec.shape)
    return value.requires_grad_() if grad else value
