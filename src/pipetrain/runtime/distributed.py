"""The torch.distributed transport: stages in other processes, point to point over c10d.

Each message is one CPU buffer made by :mod:`.wire` (metadata and tensors together),
sent with ``isend`` over a gloo process group (tensors on a GPU are staged through it;
the receiving stage moves them to its device). gloo delivers a message into a receive buffer at least as large as the
message, so the receiver posts a buffer of the channel's current *capacity*; a message
that does not fit is announced by a small ``GROW`` message first, and both ends then use
the new capacity. Shapes may therefore change from one micro-batch to the next with no
warm-up and no extra round trip.

For every inbound channel a *pump* thread posts the next receive as soon as the previous
one completed, so transfers overlap the compute of the main thread. The pump posts only
as many receives as the runtime announced with :meth:`DistTransport.expect` (credits),
so nothing is left pending between steps.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.errors import PeerFailure, PipelineError
from pipetrain.runtime.transport import Channel, Mailbox
from pipetrain.runtime.wire import KIND_DATA, KIND_GROW, pack, pack_control, read_prefix, unpack

__all__ = ["DistTransport"]

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_INITIAL_CAPACITY = 1 << 16
_MAX_PENDING_SENDS = 64


def _next_capacity(nbytes: int) -> int:
    capacity = _INITIAL_CAPACITY
    while capacity < nbytes:
        capacity *= 2
    return capacity


class _Pump:
    """Receives the messages of one inbound channel in a background thread."""

    def __init__(self, transport: DistTransport, channel: Channel, src: int) -> None:
        self.channel = channel
        self.src = src
        self.credits = threading.Semaphore(0)
        self.capacity = _INITIAL_CAPACITY
        self.closing = False
        self._transport = transport
        self.thread = threading.Thread(
            target=self._run, name=f"pipetrain-recv-{channel}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        transport = self._transport
        try:
            while True:
                self.credits.acquire()
                if self.closing:
                    return
                while True:
                    buffer = torch.empty(self.capacity, dtype=torch.uint8)
                    work = dist.irecv(
                        buffer, src=self.src, group=transport.group, tag=self.channel.tag
                    )
                    assert work is not None
                    work.wait()
                    kind, _, total = read_prefix(buffer)
                    if kind == KIND_GROW:
                        self.capacity = total
                        continue
                    assert kind == KIND_DATA, kind
                    message = unpack(buffer[:total] if total * 2 < self.capacity else buffer)
                    transport.mailbox.put(self.channel, message.microbatch, message.value)
                    break
        except Exception as error:  # the peer died, or the process group was torn down
            if not self.closing:
                transport.mailbox.fail(transport.explain_failure(error, peer=self.src))


class DistTransport:
    """Transport between stages in different processes of a torch.distributed job.

    ``stage_to_rank[j]`` is the *global* rank that holds stage ``j`` in this pipeline
    (with data parallelism each replica's pipeline has its own ranks). ``inbound`` and
    ``outbound`` list this rank's channels; ``group`` is the process group used for the
    point-to-point traffic (default: the world). ``check`` is a health check that
    raises when a peer died (see :class:`pipetrain.runtime.monitor.PeerMonitor`).

    Example (inside an initialized gloo job of two ranks)::

        t = DistTransport(stage_to_rank=[0, 1], inbound=[...], outbound=[...], timeout=60)
        t.expect(Channel(ACTIVATION, 0, 1), 4)   # four receives coming on this channel
        value = t.recv(Channel(ACTIVATION, 0, 1), 0)
    """

    def __init__(
        self,
        *,
        stage_to_rank: Sequence[int],
        inbound: Iterable[Channel],
        outbound: Iterable[Channel],
        timeout: float,
        group: dist.ProcessGroup | None = None,
        check: Callable[[], None] | None = None,
        explain: Callable[[BaseException, int], PipelineError] | None = None,
    ) -> None:
        self.stage_to_rank = tuple(stage_to_rank)
        self.group = group
        self.timeout = timeout
        self.mailbox = Mailbox()
        self._check = check
        self._explain = explain
        self._send_capacity: dict[Channel, int] = {
            c: _INITIAL_CAPACITY for c in outbound
        }
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._pumps = {
            c: _Pump(self, c, self.stage_to_rank[c.src_stage]) for c in inbound
        }

    def explain_failure(self, error: BaseException, *, peer: int) -> PipelineError:
        """Turn a communication error with ``peer`` into the error the user sees."""
        if self._explain is not None:
            return self._explain(error, peer)
        return PeerFailure(
            f"communication with rank {peer} failed: {error}", dead_ranks=(peer,)
        )

    def expect(self, channel: Channel, count: int) -> None:
        """Announce ``count`` more messages on ``channel``; the pump posts them ahead."""
        pump = self._pumps.get(channel)
        if pump is None:
            raise PipelineError(
                f"no inbound channel {channel} on this rank (inbound: {sorted(self._pumps)})"
            )
        for _ in range(count):
            pump.credits.release()

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        dst = self.stage_to_rank[channel.dst_stage]
        buffer = pack(value, microbatch=microbatch, device=_CPU)
        capacity = self._send_capacity.get(channel)
        if capacity is None:
            raise PipelineError(f"no outbound channel {channel} on this rank")
        if buffer.numel() > capacity:
            capacity = _next_capacity(buffer.numel())
            self._post(pack_control(KIND_GROW, total=capacity), dst, channel.tag)
            self._send_capacity[channel] = capacity
        self._post(buffer, dst, channel.tag)

    def _post(self, buffer: torch.Tensor, dst: int, tag: int) -> None:
        work = dist.isend(buffer, dst=dst, group=self.group, tag=tag)
        self._pending.append((work, buffer))
        while len(self._pending) > _MAX_PENDING_SENDS:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, _ = self._pending.popleft()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as error:
            failure = self.mailbox.error or self.explain_failure(error, peer=-1)
            self.mailbox.fail(failure)
            raise failure from error

    def recv(self, channel: Channel, microbatch: int) -> Any:
        return self.mailbox.get(channel, microbatch, timeout=self.timeout, check=self._check)

    def flush(self) -> None:
        while self._pending:
            self._wait_oldest()

    def close(self) -> None:
        for pump in self._pumps.values():
            pump.closing = True
            pump.credits.release()
        for pump in self._pumps.values():
            pump.thread.join(timeout=1.0)
        self._pending.clear()
        self.mailbox.clear()
