"""The communication stream: where a rank issues its point-to-point traffic on a GPU.

On a CUDA device, sends and receives are issued on a stream of their own, so the
transfers overlap the compute stream's work instead of queueing behind it:

* a send first makes the communication stream wait on an event recorded on the
  compute stream (the tensor is complete), then issues the send there; the sent tensor
  is marked as used by the communication stream (``record_stream``), so the caching
  allocator does not hand its memory to the compute stream while it is in flight;
* a receive buffer is allocated and the receive posted on the communication stream
  (by whichever thread posts it); once the receive's work is waited for on the compute
  stream (NCCL's ``Work.wait()`` makes the current stream wait, without blocking the
  host), the buffer is marked as used by the compute stream.

The NCCL process group itself runs each operation on its internal stream, which waits
on the stream current at the call (here: the communication stream). On the CPU every
method is a no-op, so the same transport code runs there unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["CommStream"]


class CommStream:
    """The communication stream of ``device`` (none on the CPU).

    Example:
        >>> streams = CommStream(torch.device("cpu"))
        >>> with streams.sending([torch.ones(2)]):
        ...     pass   # issue the sends here
        >>> streams.stream is None
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda" else None
        )

    @contextlib.contextmanager
    def sending(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """A block that issues the sends of ``tensors`` (produced on the current stream)."""
        if self.stream is None:
            yield
            return
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            yield
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(self.stream)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """A block (any thread) that allocates receive buffers and posts the receives."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def arrived(self, tensors: Iterable[torch.Tensor]) -> None:
        """Mark received ``tensors`` as used by the current (compute) stream; call after
        waiting for their receives on it."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(current)
