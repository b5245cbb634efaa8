"""The torch.distributed transport: stages in other processes, point to point over c10d.

A message is a header and the tensors that travel apart from it (:mod:`.wire`), on the
link from its sender to its receiver (:mod:`.links`). Tensors keep their device: on a
GPU they go through the job's backend (NCCL) from the sender's device memory into a
buffer on the receiver's device, issued on a communication stream
(:mod:`.comm_stream`), as torch's own pipelining does. The header (shapes, dtypes,
nested structure, ``requires_grad``; so dynamic shapes and uneven micro-batches need no
warm-up) travels on a small gloo side channel: the job's group on the CPU, a gloo group
of its own under NCCL.

Receives are posted early. When a step starts, :meth:`DistTransport.expect` posts a
header receive for every message the step will get, into buffers of the transport's
*capacity* (gloo delivers a message into any buffer at least as large); a header larger
than that is announced by a notice and follows on an overflow tag. Each header's data
receives are posted as soon as the header is in.

One code path, one difference on the CPU: host tensors whose bytes fit in
``inline_limit`` travel *inside* their header (one gloo message per activation instead
of two; the 2-core CPU benchmark's case), and larger ones apart, exactly as device
tensors do. ``inline_limit=0`` sends everything apart (the NCCL path, run on gloo).

Who takes the headers: with ``receive_thread`` one thread per inbound link waits for
them as they come and posts their data receives at once (needed where the data must
flow before the receive action runs: NCCL, and large apart messages); the main thread
then waits in the mailbox, where the peer monitor's failure wakes it. Without it the
main thread takes the headers itself when a receive action runs (a dead peer still
fails its wait at once: its connection closes).
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.comm_stream import CommStream
from pipetrain.runtime.errors import PeerFailure, PipelineError
from pipetrain.runtime.links import (
    TAG_DATA,
    TAG_HEADER,
    TAG_OVERFLOW,
    Arrival,
    InboundLink,
    post_batch,
    wait_work,
)
from pipetrain.runtime.sends import SendsInFlight
from pipetrain.runtime.transport import Channel, Mailbox, Placement
from pipetrain.runtime.wire import DEVICE, encode, encode_notice

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_INLINE_LIMIT", "DistTransport"]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1 << 20
"""Bytes of a pre-posted header receive; larger headers take a second message."""
DEFAULT_INLINE_LIMIT = DEFAULT_CAPACITY - (16 << 10)
"""Bytes of host tensors a header carries inline (the rest of the capacity: metadata)."""
_MAX_PENDING_SENDS = 256


def _is_nccl(group: Any) -> bool:
    return bool(dist.get_backend(group) == "nccl")


class DistTransport:
    """Transport between stages in different processes of a torch.distributed job.

    ``placement`` names the *global* rank that runs each micro-batch of each stage (with
    replicated stages, a channel's messages come from and go to several ranks, by
    micro-batch). ``inbound`` and ``outbound`` list this rank's channels. ``group`` is
    the gloo group of the headers (default: the world); ``data_groups`` the data group
    of each link ``(src, dst)`` (default: ``group``; with NCCL, from
    :func:`~pipetrain.runtime.links.link_groups`); ``device`` where received device
    tensors land (this rank's device). ``check`` raises when the peer monitor found a
    dead peer; ``explain`` turns a communication error into the error the user sees
    (naming the rank that failed first).

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
        data_groups: Mapping[tuple[int, int], dist.ProcessGroup] | None = None,
        device: torch.device | None = None,
        check: Callable[[], None] | None = None,
        explain: Callable[[BaseException, int], PipelineError] | None = None,
        capacity: int = DEFAULT_CAPACITY,
        inline_limit: int | None = None,
        receive_thread: bool | None = None,
    ) -> None:
        self.placement = placement
        self.group = group if group is not None else dist.group.WORLD
        self.data_groups = dict(data_groups or {})
        self.device = device if device is not None else torch.device("cpu")
        self.timeout = timeout
        self.capacity = capacity
        self.inline_limit = min(DEFAULT_INLINE_LIMIT, capacity // 2) if inline_limit is None else inline_limit
        self.receive_thread = (self.device.type != "cpu" if receive_thread is None else receive_thread)
        self.rank = dist.get_rank()
        """This process's global rank."""
        self.mailbox = Mailbox()
        """Arrived messages not yet asked for, and the first failure (if any)."""
        self.streams = CommStream(self.device)
        self._check = check
        self._explain = explain
        self._outbound = set(outbound)
        self._inbound = {c.tag: c for c in inbound}
        self._links: dict[int, InboundLink] = {}
        self._threads: list[threading.Thread] = []
        self._sends = SendsInFlight(wait=self._wait, fail=self._fail, limit=_MAX_PENDING_SENDS)
        """Posted sends, their buffers kept alive until each is done."""
        self._wait_timeout = datetime.timedelta(seconds=timeout)

    def _data_group(self, src: int, dst: int) -> Any:
        return self.data_groups.get((src, dst), self.group)

    def _timeout_of(self, group: Any) -> datetime.timedelta | None:
        return None if _is_nccl(group) else self._wait_timeout

    # -- failures -----------------------------------------------------------------------
    def explain_failure(self, error: BaseException, *, peer: int) -> PipelineError:
        """Turn a communication error with ``peer`` into the error the user sees."""
        if self._explain is not None:
            return self._explain(error, peer)
        return PeerFailure(f"communication with rank {peer} failed: {error}", dead_ranks=(peer,))

    def _fail(self, error: BaseException, peer: int) -> PipelineError:
        if self._check is not None:
            try:
                self._check()
            except PipelineError as found:
                self.mailbox.fail(found)
                return found
        failure = self.mailbox.error
        if not isinstance(failure, PipelineError):
            failure = self.explain_failure(error, peer=peer)
            self.mailbox.fail(failure)
        return failure

    def _wait(self, work: Any, timeout: datetime.timedelta | None, peer: int) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        try:
            wait_work(work, timeout=timeout)
        except Exception as error:
            raise self._fail(error, peer) from error

    # -- receiving ----------------------------------------------------------------------
    def _link(self, src: int) -> InboundLink:
        link = self._links.get(src)
        if link is None:
            data_group = self._data_group(src, self.rank)
            link = InboundLink(
                src, header_group=self.group, data_group=data_group, device=self.device,
                capacity=self.capacity, streams=self.streams, header_timeout=self._wait_timeout,
                data_timeout=self._timeout_of(data_group), deliver=self._deliver,
            )
            self._links[src] = link
            if self.receive_thread:
                thread = threading.Thread(target=link.run, args=(self._thread_failed,),
                                          name=f"pipetrain-recv-{src}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return link

    def _deliver(self, tag: int, microbatch: int, arrival: Arrival) -> None:
        channel = self._inbound.get(tag)
        if channel is None:
            raise PipelineError(
                f"rank {arrival.src} sent a message with tag {tag}, which is no inbound channel "
                f"of this rank ({sorted(map(str, self._inbound.values()))}): the ranks run "
                "different layouts"
            )
        self.mailbox.put(channel, microbatch, arrival)

    def _thread_failed(self, error: BaseException, src: int) -> None:
        self._fail(error, src)

    def expect(self, channel: Channel, microbatches: Sequence[int]) -> None:
        """Post the header receives of ``microbatches`` on ``channel`` now, each from the
        rank that runs it on the sending stage."""
        if channel.tag not in self._inbound:
            raise PipelineError(
                f"no inbound channel {channel} on this rank (inbound: "
                f"{sorted(map(str, self._inbound.values()))})"
            )
        counts: dict[int, int] = collections.Counter(
            self.placement.rank(channel.src_stage, i) for i in microbatches)
        for src, count in sorted(counts.items()):
            self._link(src).post(count)

    def _arrival(self, channel: Channel, microbatch: int) -> Arrival:
        if self.receive_thread:
            arrival: Arrival = self.mailbox.get(channel, microbatch, timeout=self.timeout,
                                                check=self._check)
            return arrival
        src = self.placement.rank(channel.src_stage, microbatch)
        link = self._link(src)
        while True:
            waiting = self.mailbox.take(channel, microbatch)
            if waiting is not Mailbox.EMPTY:
                return waiting  # type: ignore[no-any-return]
            if self.mailbox.error is not None:
                raise self.mailbox.error
            try:
                message = link.next()
            except PipelineError:
                raise
            except Exception as error:
                raise self._fail(error, src) from error
            if message is None:
                raise PipelineError(
                    f"the {channel.kind}s of micro-batch {microbatch} on channel {channel} were "
                    "never announced with expect(): the action list and the transport disagree"
                )
            tag, arrived, arrival = message
            if tag == channel.tag and arrived == microbatch:
                return arrival  # the one asked for: past the mailbox
            self._deliver(tag, arrived, arrival)

    def recv(self, channel: Channel, microbatch: int) -> Any:
        arrival = self._arrival(channel, microbatch)
        if arrival.works:
            for work, timeout in arrival.works:
                self._wait(work, timeout, arrival.src)
            self.streams.arrived(arrival.buffers)
        return arrival.header.value(arrival.buffers)

    # -- sending ------------------------------------------------------------------------
    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        if channel not in self._outbound:
            raise PipelineError(f"no outbound channel {channel} on this rank")
        dst = self.placement.rank(channel.dst_stage, microbatch)
        encoded = encode(value, tag=channel.tag, microbatch=microbatch,
                         device_type=self.device.type, inline_limit=self.inline_limit)
        header = encoded.header
        tensors = [header] + [t for _, t in encoded.apart]
        if header.numel() > self.capacity:
            notice = encode_notice(tag=channel.tag, microbatch=microbatch, total=header.numel())
            tensors.append(notice)
            works = [dist.isend(notice, dst=dst, group=self.group, tag=TAG_HEADER),
                     dist.isend(header, dst=dst, group=self.group, tag=TAG_OVERFLOW)]
        else:
            works = [dist.isend(header, dst=dst, group=self.group, tag=TAG_HEADER)]
        timed: list[tuple[Any, datetime.timedelta | None]] = [(w, self._wait_timeout) for w in works]
        if encoded.apart:  # everything else travels after the header, on its own route
            data_group = self._data_group(self.rank, dst)
            with self.streams.sending(t for _, t in encoded.apart):
                ops = [dist.P2POp(dist.isend, t, dst, data_group if route == DEVICE else self.group,
                                  TAG_DATA)
                       for route, t in encoded.apart if t.numel()]  # an empty tensor is not sent
                if ops:
                    timed.extend((w, self._timeout_of(g)) for w, g in post_batch(ops))
        self._sends.add(dst, timed, tensors)

    def _raise_failure(self) -> None:
        if self.mailbox.error is not None:
            raise self.mailbox.error
        if self._check is not None:
            self._check()

    def flush(self) -> None:
        self._sends.drain(check=self._raise_failure)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        for thread in self._threads:  # idle ones end at once; one blocked in a wait is left
            thread.join(timeout=1.0)
        self._threads.clear()
        self._links.clear()
        self._sends.close()
        self.mailbox.clear()
