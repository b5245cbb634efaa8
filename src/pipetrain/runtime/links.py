"""Links: the ordered messages from one rank to another, and the process groups they use.

Every message from rank ``a`` to rank ``b`` (whatever its channel) travels on the link
``a -> b``, in the order ``a`` sent it: its header on the header group (gloo, CPU
buffers) under :data:`TAG_HEADER`, then its apart tensors (see :mod:`.wire`) under
:data:`TAG_DATA`, device tensors on the link's *data group* (the job's backend). The
receiver posts header receives ahead (:meth:`InboundLink.post`), takes the headers in
order (:meth:`InboundLink.advance`), and posts each header's data receives as soon as
the header is in, so the data flows while the receiver computes.

With NCCL every direction of every link gets a process group of its own
(:func:`link_groups`): NCCL matches point-to-point operations by their order on a
communicator, and a communicator that carries one direction of one link carries one
ordered stream of sends, so no send can wait behind a receive on the same NCCL stream
(the deadlock that torch's pipelining avoids by grouping the sends and receives of a
tick). The apart tensors of one message are posted as one ``batch_isend_irecv``
(a single NCCL group call; one operation after another on gloo).
"""

from __future__ import annotations

import collections
import datetime
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.comm_stream import CommStream
from pipetrain.runtime.transport import Placement
from pipetrain.runtime.wire import DEVICE, KIND_LARGE, Header, decode

__all__ = [
    "TAG_DATA",
    "TAG_HEADER",
    "TAG_OVERFLOW",
    "Arrival",
    "InboundLink",
    "directed_links",
    "link_groups",
    "post_batch",
    "wait_work",
]

TAG_HEADER = 1 << 20
"""Tag of the headers of a link (and of the notices of large headers)."""
TAG_OVERFLOW = TAG_HEADER + 1
"""Tag of a header too large for the receiver's pre-posted buffer."""
TAG_DATA = TAG_HEADER + 2
"""Tag of the apart tensors (gloo matches by tag; NCCL by order on the link's group)."""
_CPU = torch.device("cpu")


def directed_links(placement: Placement) -> list[tuple[int, int]]:
    """Every ``(src, dst)`` pair of ranks between which messages travel, sorted.

    Example:
        >>> directed_links(Placement([(0,), (1, 2)]))
        [(0, 1), (0, 2), (1, 0), (2, 0)]
    """
    links: set[tuple[int, int]] = set()
    for j in range(placement.num_stages - 1):
        cycle = math.lcm(len(placement.ranks(j)), len(placement.ranks(j + 1)))
        for i in range(cycle):
            src, dst = placement.rank(j, i), placement.rank(j + 1, i)
            if src != dst:
                links.update({(src, dst), (dst, src)})
    return sorted(links)


def link_groups(placement: Placement, *, rank: int, backend: str | None = None
                ) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One process group per direction of every link; the ones of ``rank`` by ``(src, dst)``.

    A collective: every rank of the job calls it with the same placement (groups are
    created in the same order everywhere). ``backend`` defaults to the job's.

    Example (in every process of a job)::

        groups = link_groups(layout.placement(), rank=dist.get_rank())
    """
    mine: dict[tuple[int, int], dist.ProcessGroup] = {}
    for src, dst in directed_links(placement):
        group = dist.new_group(sorted((src, dst)), backend=backend)
        if rank in (src, dst):
            assert group is not None
            mine[(src, dst)] = group
    return mine


def wait_work(work: Any, *, timeout: datetime.timedelta | None) -> None:
    """Wait for ``work``: bounded by ``timeout`` on gloo (``None`` for NCCL, whose
    ``wait()`` only makes the current CUDA stream wait and must not block the host)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def post_batch(ops: list[dist.P2POp]) -> list[tuple[Any, Any]]:
    """Post ``ops`` (several groups allowed; each group's ops stay in order) as one
    ``batch_isend_irecv`` per group; ``(work, group)`` of each work."""
    by_group: dict[int, list[dist.P2POp]] = {}
    for op in ops:
        by_group.setdefault(id(op.group), []).append(op)
    works: list[tuple[Any, Any]] = []
    for batch in by_group.values():
        works.extend((w, batch[0].group) for w in dist.batch_isend_irecv(batch) if w is not None)
    return works


@dataclass
class Arrival:
    """A message whose header is in and whose apart tensors are posted."""

    header: Header
    works: list[tuple[Any, datetime.timedelta | None]]
    """The data receives and how to wait for each."""
    buffers: list[torch.Tensor]
    src: int


class InboundLink:
    """The messages from rank ``src``: header receives posted ahead, taken in order.

    ``deliver(header_tag, microbatch, arrival)`` files each message; ``wait(work,
    timeout)`` waits for a header receive (raising the failure the user sees).
    """

    def __init__(
        self,
        src: int,
        *,
        header_group: dist.ProcessGroup | None,
        data_group: dist.ProcessGroup | None,
        device: torch.device,
        capacity: int,
        streams: CommStream,
        header_timeout: datetime.timedelta,
        data_timeout: datetime.timedelta | None,
        deliver: Callable[[int, int, Arrival], None],
    ) -> None:
        self.src = src
        self.header_group = header_group
        self.data_group = data_group
        self.device = device
        self.capacity = capacity
        self.streams = streams
        self.header_timeout = header_timeout
        self.data_timeout = data_timeout
        self.deliver = deliver
        self.closing = False
        self.condition = threading.Condition()
        self._posted: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def post(self, count: int) -> None:
        """Post ``count`` more header receives into buffers of the link's capacity."""
        with self.condition:
            for _ in range(count):
                buffer = torch.empty(self.capacity, dtype=torch.uint8)
                work = dist.irecv(buffer, src=self.src, group=self.header_group, tag=TAG_HEADER)
                self._posted.append((work, buffer))
            self.condition.notify_all()

    @property
    def posted(self) -> int:
        """Header receives posted and not taken yet."""
        return len(self._posted)

    def advance(self) -> bool:
        """Wait for the next header, post its data receives and deliver it; ``False``
        when no header receive is posted."""
        message = self.next()
        if message is None:
            return False
        self.deliver(*message)
        return True

    def next(self) -> tuple[int, int, Arrival] | None:
        """Wait for the next header and post its data receives: ``(channel tag,
        micro-batch, arrival)``, or ``None`` when no header receive is posted."""
        with self.condition:
            if not self._posted:
                return None
            work, buffer = self._posted.popleft()
        wait_work(work, timeout=self.header_timeout)
        header = decode(buffer, capacity=self.capacity)
        if header.kind == KIND_LARGE:
            buffer = torch.empty(header.total, dtype=torch.uint8)
            large = dist.irecv(buffer, src=self.src, group=self.header_group, tag=TAG_OVERFLOW)
            wait_work(large, timeout=self.header_timeout)
            header = decode(buffer)
        if not header.apart:  # everything inline: the usual message on the CPU
            return header.tag, header.microbatch, Arrival(header, [], [], self.src)
        ops: list[dist.P2POp] = []
        buffers: list[torch.Tensor] = []
        with self.streams.receiving():
            for spec in header.apart:
                on_device = spec.route == DEVICE
                received = torch.empty(spec.nbytes, dtype=torch.uint8,
                                       device=self.device if on_device else _CPU)
                group = self.data_group if on_device else self.header_group
                if spec.nbytes:  # an empty tensor is not sent
                    ops.append(dist.P2POp(dist.irecv, received, self.src, group, TAG_DATA))
                buffers.append(received)
            works = post_batch(ops) if ops else []
        timed = [(w, self.header_timeout if g is self.header_group else self.data_timeout)
                 for w, g in works]
        return header.tag, header.microbatch, Arrival(header, timed, buffers, self.src)

    def run(self, fail: Callable[[BaseException, int], None]) -> None:
        """Take headers as they are posted until :meth:`close` (a receive thread's body)."""
        while True:
            with self.condition:
                while not self._posted and not self.closing:
                    self.condition.wait()
                if self.closing:
                    return
            try:
                self.advance()
            except BaseException as error:
                if not self.closing:
                    fail(error, self.src)
                return

    def close(self) -> None:
        """Stop the receive thread (if any) and forget the posted receives."""
        with self.condition:
            self.closing = True
            self._posted.clear()
            self.condition.notify_all()
