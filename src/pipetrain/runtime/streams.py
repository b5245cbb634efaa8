"""CUDA streams of a single-process pipeline: each stage computes on its own stream,
values cross devices on copy streams, and events order the two (torchgpipe's design).

Stage ``j`` on a GPU runs its forward, recomputations and backward with its own compute
stream current (:meth:`PipelineStreams.stage`; autograd runs a backward op on its forward
op's stream), so stages that share a GPU may overlap there. A message (activations, or
gradients coming back) is shipped by the sending stage's thread right after it is made
(:meth:`PipelineStreams.ship`):

- to a stage on the same GPU: an event recorded on the sender's compute stream goes
  with the tensors;
- to another device: a copy stream of the sender's device first waits for the sender's
  compute stream, the copy runs there (a cross-device copy runs on the source device's
  current stream, fenced with the destination's current stream: the receiver's copy
  stream), and an event recorded on the receiver's copy stream goes with the copies.

The receiving thread (:meth:`PipelineStreams.land`) makes its compute stream wait for that
event, and marks every tensor it received as used by its compute stream
(``record_stream``: the caching allocator then does not hand the memory to the stream it
was allocated on before that use is done); a source tensor is likewise marked as used by
the copy stream. At the pipeline's edges, every stage stream waits for the caller's
current streams before the stages start (:meth:`PipelineStreams.enter`: the inputs, the
output gradients, updated weights), and the caller's current streams wait for every
stage stream before the caller goes on (:meth:`PipelineStreams.leave`: outputs, input and
weight gradients). A stage on the CPU has no stream: what reaches it is complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipetrain.nested import iter_tensors, map_tensors
from pipetrain.runtime.threads import ThreadTransport
from pipetrain.runtime.transport import Channel

__all__ = ["PipelineStreams", "StreamTransport"]


def _stream_of(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]


class PipelineStreams:
    """The CUDA streams of the stages placed on ``devices`` (one per stage).

    Created when the pipeline first runs (creating a stream initializes CUDA); with no
    stage on a GPU (:meth:`needed` is false) every method does nothing.

    Example:
        >>> PipelineStreams.needed([torch.device("cpu")] * 2)
        False
        >>> with PipelineStreams([]).edges():  # no GPU: nothing to order
        ...     pass
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.compute = [_stream_of(d) for d in self.devices]
        """each stage's compute stream (``None`` on the CPU)"""
        self.outgoing = [_stream_of(d) for d in self.devices]
        """copy streams for what each stage sends to another device (on its device)"""
        self.incoming = [_stream_of(d) for d in self.devices]
        """copy streams for what each stage receives from another device (on its device)"""

    @property
    def active(self) -> bool:
        """Whether some stage is on a GPU."""
        return any(stream is not None for stream in self.compute)

    @staticmethod
    def needed(devices: Sequence[torch.device]) -> bool:
        """Whether a pipeline on ``devices`` has a stage on a GPU."""
        return any(torch.device(d).type == "cuda" for d in devices)

    @contextlib.contextmanager
    def stage(self, j: int) -> Iterator[None]:
        """Run stage ``j``'s work (on its thread) with its compute stream current (none
        for a stage these streams do not cover: then nothing changes)."""
        stream = self.compute[j] if j < len(self.compute) else None
        if stream is None:
            yield
            return
        with torch.cuda.device(self.devices[j]), torch.cuda.stream(stream):
            yield

    def _cuda_devices(self) -> list[torch.device]:
        return list(dict.fromkeys(d for d in self.devices if d.type == "cuda"))

    def enter(self) -> None:
        """The stages' work comes after the caller's so far (caller's thread)."""
        callers = {d: torch.cuda.current_stream(d) for d in self._cuda_devices()}
        for device, stream in zip(self.devices, self.compute):
            if stream is not None:
                stream.wait_stream(callers[device])

    def leave(self) -> None:
        """The caller's later work comes after the stages' (caller's thread)."""
        for device in self._cuda_devices():
            caller = torch.cuda.current_stream(device)
            for stream in self.compute:
                if stream is not None:
                    caller.wait_stream(stream)

    @contextlib.contextmanager
    def edges(self) -> Iterator[None]:
        """:meth:`enter` before the block (the stages' run), :meth:`leave` after it."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def ship(self, value: Any, src: int, dst: int) -> tuple[Any, torch.cuda.Event | None]:
        """What stage ``src`` sends to stage ``dst``, on ``dst``'s device, with the event
        ``dst`` must wait for; called on ``src``'s thread right after making ``value``."""
        source, target = self.devices[src], self.devices[dst]
        if source.type != "cuda" and target.type != "cuda":
            return value, None
        compute = self.compute[src]
        if source == target:
            assert compute is not None
            return value, compute.record_event()
        outgoing, incoming = self.outgoing[src], self.incoming[dst]
        with contextlib.ExitStack() as streams:
            if outgoing is not None:
                assert compute is not None
                streams.enter_context(torch.cuda.stream(outgoing))
                outgoing.wait_stream(compute)  # the value is made
            if incoming is not None:
                streams.enter_context(torch.cuda.stream(incoming))

            def move(tensor: torch.Tensor) -> torch.Tensor:
                if outgoing is not None and tensor.is_cuda:
                    tensor.record_stream(outgoing)  # read by the copy
                # to the CPU: a blocking copy (the host waits for it)
                copy = tensor.detach().to(target, non_blocking=target.type == "cuda")
                return copy.requires_grad_(tensor.requires_grad)

            moved = map_tensors(move, value)
            event = incoming.record_event() if incoming is not None else None
        return moved, event

    def land(self, shipped: tuple[Any, torch.cuda.Event | None], dst: int) -> Any:
        """The value shipped to stage ``dst``, ready for its compute stream (``dst``'s
        thread)."""
        value, event = shipped
        compute = self.compute[dst]
        if compute is None:
            if event is not None:
                event.synchronize()
            return value
        if event is not None:
            compute.wait_event(event)
        for tensor in iter_tensors(value):
            if tensor.is_cuda:
                tensor.record_stream(compute)  # used there, whichever stream made it
        return value


class StreamTransport(ThreadTransport):
    """The thread transport, with values shipped between the stages' CUDA streams.

    Example:
        >>> streams = PipelineStreams([torch.device("cpu")] * 2)  # CPU: nothing to order
        >>> t = StreamTransport(streams, timeout=5.0)
        >>> from pipetrain.runtime.transport import ACTIVATION
        >>> t.send(Channel(ACTIVATION, 0, 1), 0, torch.ones(2))
        >>> t.recv(Channel(ACTIVATION, 0, 1), 0)
        tensor([1., 1.])
    """

    def __init__(self, streams: PipelineStreams, *, timeout: float) -> None:
        super().__init__(timeout=timeout)
        self.streams = streams

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        shipped = self.streams.ship(value, channel.src_stage, channel.dst_stage)
        super().send(channel, microbatch, shipped)

    def recv(self, channel: Channel, microbatch: int) -> Any:
        return self.streams.land(super().recv(channel, microbatch), channel.dst_stage)
