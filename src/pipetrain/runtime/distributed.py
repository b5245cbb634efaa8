"""The torch.distributed transport: stages in other processes, point to point over c10d.

Each message is one CPU buffer made by :mod:`.wire` (metadata and tensors together),
sent with ``isend`` over a gloo process group (tensors on a GPU are staged through it;
the receiving stage moves them to its device). gloo delivers a message into a receive
buffer at least as large as the message, so receives need not know the size: when a
step starts, :meth:`DistTransport.expect` posts every receive the step will need into
buffers of the transport's *capacity*, and the data flows while the rank computes. A
message larger than the capacity is announced by a small notice and follows on the
channel's overflow tag, into a buffer of its exact size.

Nothing runs in the background: a receive is waited for when the schedule's receive
action runs. A dead peer breaks the connection and the wait fails at once; a silent one
is caught by the peer monitor.
"""

from __future__ import annotations

import collections
import datetime
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.errors import PeerFailure, PipelineError
from pipetrain.runtime.transport import Channel, Mailbox, Placement
from pipetrain.runtime.wire import KIND_LARGE, pack, pack_large_notice, read_prefix, unpack

__all__ = ["DEFAULT_CAPACITY", "DistTransport"]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1 << 20
"""Bytes of a pre-posted receive; larger messages take a second message."""
_OVERFLOW_TAG = 1 << 20
_CPU = torch.device("cpu")
_MAX_PENDING_SENDS = 256


class DistTransport:
    """Transport between stages in different processes of a torch.distributed job.

    ``placement`` names the *global* rank that runs each micro-batch of each stage (with
    replicated stages, a channel's messages come from and go to several ranks, by
    micro-batch). ``inbound`` and ``outbound`` list this rank's channels; ``group`` is the process group of the point
    to point traffic (a gloo group; default: the world). ``check`` raises when the peer
    monitor found a dead peer; ``explain`` turns a communication error into the error
    the user sees (naming the rank that failed first).

    Example (inside an initialized gloo job of two ranks)::

        t = DistTransport(placement=Placement.single([0, 1]), inbound=[...], outbound=[...],
                          timeout=60)
        t.expect(Channel(ACTIVATION, 0, 1), [0, 1, 2, 3])   # four receives coming
        value = t.recv(Channel(ACTIVATION, 0, 1), 0)
    """

    def __init__(
        self,
        *,
        placement: Placement,
        inbound: Iterable[Channel],
        outbound: Iterable[Channel],
        timeout: float,
        group: dist.ProcessGroup | None = None,
        check: Callable[[], None] | None = None,
        explain: Callable[[BaseException, int], PipelineError] | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.placement = placement
        self.group = group
        self.timeout = timeout
        self.capacity = capacity
        self.mailbox = Mailbox()
        """Received values not yet asked for, and the first failure (if any)."""
        self._check = check
        self._explain = explain
        self._outbound = set(outbound)
        self._inbound = set(inbound)
        # posted receives by (channel, source rank), in the order they were posted
        self._posted: dict[tuple[Channel, int], collections.deque[tuple[Any, torch.Tensor]]] = {
            (c, src): collections.deque() for c in self._inbound for src in placement.ranks(c.src_stage)
        }
        self._pending: collections.deque[tuple[Any, torch.Tensor, int]] = collections.deque()
        """Posted sends: (work, buffer kept alive until done, destination rank)."""
        self._wait_timeout = datetime.timedelta(seconds=timeout)

    def explain_failure(self, error: BaseException, *, peer: int) -> PipelineError:
        """Turn a communication error with ``peer`` into the error the user sees."""
        if self._explain is not None:
            return self._explain(error, peer)
        return PeerFailure(f"communication with rank {peer} failed: {error}", dead_ranks=(peer,))

    def _fail(self, error: BaseException, peer: int) -> PipelineError:
        failure = self.mailbox.error
        if not isinstance(failure, PipelineError):
            failure = self.explain_failure(error, peer=peer)
            self.mailbox.fail(failure)
        return failure

    def _wait(self, work: Any, peer: int) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        try:
            work.wait(self._wait_timeout)
        except Exception as error:
            if self._check is not None:
                try:
                    self._check()
                except PipelineError as failure:
                    self.mailbox.fail(failure)
                    raise failure from error
            raise self._fail(error, peer) from error

    # -- receiving ----------------------------------------------------------------------
    def expect(self, channel: Channel, microbatches: Sequence[int]) -> None:
        """Post the receives of ``microbatches`` on ``channel`` now (data flows in
        meanwhile), each from the rank that runs it on the sending stage."""
        if channel not in self._inbound:
            raise PipelineError(
                f"no inbound channel {channel} on this rank (inbound: {sorted(self._inbound)})"
            )
        for microbatch in microbatches:
            src = self.placement.rank(channel.src_stage, microbatch)
            buffer = torch.empty(self.capacity, dtype=torch.uint8)
            work = dist.irecv(buffer, src=src, group=self.group, tag=channel.tag)
            self._posted[(channel, src)].append((work, buffer))

    def recv(self, channel: Channel, microbatch: int) -> Any:
        waiting = self.mailbox.take(channel, microbatch)
        if waiting is not Mailbox.EMPTY:
            return waiting
        src = self.placement.rank(channel.src_stage, microbatch)
        posted = self._posted[(channel, src)]
        while posted:
            work, buffer = posted.popleft()
            self._wait(work, src)
            kind, sent_for, _, total = read_prefix(buffer)
            if kind == KIND_LARGE:
                buffer = torch.empty(total, dtype=torch.uint8)
                large = dist.irecv(buffer, src=src, group=self.group, tag=channel.tag + _OVERFLOW_TAG)
                self._wait(large, src)
            elif total * 4 < self.capacity:
                buffer = buffer[:total].clone()  # do not pin a whole capacity per message
            message = unpack(buffer)
            if sent_for == microbatch:
                return message.value
            self.mailbox.put(channel, sent_for, message.value)
        raise PipelineError(
            f"the {channel.kind}s of micro-batch {microbatch} on channel {channel} were never "
            "announced with expect(): the action list and the transport disagree"
        )

    # -- sending ------------------------------------------------------------------------
    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        if channel not in self._outbound:
            raise PipelineError(f"no outbound channel {channel} on this rank")
        dst = self.placement.rank(channel.dst_stage, microbatch)
        buffer = pack(value, microbatch=microbatch, device=_CPU)
        if buffer.numel() > self.capacity:
            self._post(pack_large_notice(microbatch=microbatch, total=buffer.numel()), dst, channel.tag)
            self._post(buffer, dst, channel.tag + _OVERFLOW_TAG)
        else:
            self._post(buffer, dst, channel.tag)

    def _post(self, buffer: torch.Tensor, dst: int, tag: int) -> None:
        work = dist.isend(buffer, dst=dst, group=self.group, tag=tag)
        self._pending.append((work, buffer, dst))
        while len(self._pending) > _MAX_PENDING_SENDS:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, _, dst = self._pending.popleft()
        self._wait(work, dst)

    def flush(self) -> None:
        while self._pending:
            self._finish_oldest()

    def close(self) -> None:
        self._pending.clear()
        for posted in self._posted.values():
            posted.clear()
        self.mailbox.clear()
