"""Transports: how a stage's activations and gradients reach the neighbouring stage.

The stage runtime talks to its neighbours only through :class:`Transport`, so the same
runtime runs with its neighbours as threads of this process (:mod:`.threads`) or as other
processes (:mod:`.distributed`). A message travels on a :class:`Channel` (activations
from stage ``j`` to ``j + 1``, or gradients from ``j + 1`` to ``j``) and is filed in the
receiver's :class:`Mailbox` under its micro-batch index, so receives may be consumed in
any order.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from pipetrain.nested import map_tensors
from pipetrain.runtime.errors import CommunicationTimeout

__all__ = ["ACTIVATION", "GRADIENT", "Channel", "Mailbox", "Placement", "Transport", "handoff"]

ACTIVATION = "activation"
GRADIENT = "gradient"


class Channel(NamedTuple):
    """A one-way link between two adjacent stages.

    ``Channel(ACTIVATION, 0, 1)`` carries stage 0's outputs to stage 1;
    ``Channel(GRADIENT, 1, 0)`` carries the gradients of stage 1's inputs back to stage 0.
    """

    kind: str
    src_stage: int
    dst_stage: int

    @property
    def boundary(self) -> int:
        """Index ``j`` of the boundary between stages ``j`` and ``j + 1``."""
        return min(self.src_stage, self.dst_stage)

    @property
    def tag(self) -> int:
        """A number unique to the channel (used as the message tag)."""
        return 2 * self.boundary + (0 if self.kind == ACTIVATION else 1)

    def __str__(self) -> str:
        return f"{self.kind}s {self.src_stage}->{self.dst_stage}"


class Placement:
    """Which rank runs micro-batch ``i`` of stage ``j``: ``groups[j][i % len(groups[j])]``
    (one rank per stage, or round-robin over a replicated stage's ranks, as
    :meth:`pipetrain.schedule.Schedule.rank_of`).

    Example:
        >>> p = Placement([(0,), (1, 2)])
        >>> p.rank(1, 0), p.rank(1, 3), p.ranks(1), p.num_stages
        (1, 2, (1, 2), 2)
        >>> Placement.single([0, 1, 0]).rank(2, 5)
        0
    """

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.groups = tuple(tuple(group) for group in groups)
        if not self.groups or any(not group for group in self.groups):
            raise ValueError(f"a placement needs at least one rank per stage, got {self.groups}")

    @staticmethod
    def single(stage_to_rank: Sequence[int]) -> Placement:
        """One rank per stage."""
        return Placement([(r,) for r in stage_to_rank])

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    def rank(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` of ``stage``."""
        group = self.groups[stage]
        return group[microbatch % len(group)]

    def ranks(self, stage: int) -> tuple[int, ...]:
        """Every rank holding ``stage``."""
        return self.groups[stage]


def _cut(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_(tensor.requires_grad)


def handoff(value: Any) -> Any:
    """What the receiving stage gets when a value stays in this process: new autograd
    leaves over the same storage, requiring grad exactly where the sender's tensors did.
    The graph of a micro-batch ends at the stage boundary, as it does between processes.

    Example:
        >>> x = torch.ones(2, requires_grad=True) * 2
        >>> y = handoff(x)
        >>> y.is_leaf, y.requires_grad
        (True, True)
    """
    return map_tensors(_cut, value)


class Transport(Protocol):
    """What the stage runtime needs from a transport."""

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        """Post ``value`` for ``microbatch`` on ``channel``; never blocks on the receiver."""

    def recv(self, channel: Channel, microbatch: int) -> Any:
        """The value sent for ``microbatch`` on ``channel``; blocks (with a timeout)."""

    def expect(self, channel: Channel, microbatches: Sequence[int]) -> None:
        """Announce the receives of ``microbatches`` on ``channel``, in the order they will be
        asked for (lets a transport post them early)."""

    def flush(self) -> None:
        """Wait until every send posted so far has left this rank."""

    def close(self) -> None:
        """Release the transport's threads and buffers."""


class Mailbox:
    """Thread-safe slots of received values keyed by (channel, micro-batch).

    Values of the same key are kept in arrival order. A failure recorded with :meth:`fail`
    wakes every waiter and is raised by every later :meth:`get`.

    Example:
        >>> box = Mailbox()
        >>> c = Channel(ACTIVATION, 0, 1)
        >>> box.put(c, 3, "x")
        >>> box.get(c, 3, timeout=1.0)
        'x'
    """

    EMPTY: Any = object()
    """What :meth:`take` returns when nothing waits under the key."""

    def __init__(self) -> None:
        self._slots: dict[tuple[Channel, int], collections.deque[Any]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def put(self, channel: Channel, microbatch: int, value: Any) -> None:
        """File ``value``; wakes a waiter of the same key."""
        with self._cond:
            self._slots.setdefault((channel, microbatch), collections.deque()).append(value)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record a failure; every waiter raises it (the first failure wins)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def condition(self) -> threading.Condition:
        """The lock (and condition) guarding the slots; notified on every change."""
        return self._cond

    @property
    def error(self) -> BaseException | None:
        """The recorded failure, if any."""
        return self._error

    def get(
        self,
        channel: Channel,
        microbatch: int,
        *,
        timeout: float,
        check: Callable[[], None] | None = None,
        poll: float = 1.0,
        idle: Callable[[], bool] | None = None,
    ) -> Any:
        """Take the oldest value of the key, waiting up to ``timeout`` seconds.

        ``check`` runs every ``poll`` seconds while waiting (a health check that raises
        when a peer died). ``idle`` runs, with :attr:`condition` held, whenever the value
        is not there yet: it may do other work (releasing the lock meanwhile) and returns
        whether it did; it is called again until it does nothing, then the wait begins.
        """
        key = (channel, microbatch)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                slot = self._slots.get(key)
                if slot:
                    value = slot.popleft()
                    if not slot:
                        del self._slots[key]
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommunicationTimeout(
                        f"waited {timeout:.0f} s for the {channel.kind}s of micro-batch "
                        f"{microbatch} from stage {channel.src_stage} to stage "
                        f"{channel.dst_stage}; the sending stage is stuck or much slower. "
                        "Raise the timeout (PipelineConfig(timeout=...)) if this is expected."
                    )
                if idle is not None and idle():
                    continue
                self._cond.wait(min(poll, remaining))
                if check is not None:
                    self._cond.release()
                    try:
                        check()
                    finally:
                        self._cond.acquire()

    def take(self, channel: Channel, microbatch: int) -> Any:
        """The oldest value of the key without waiting, or :attr:`EMPTY`."""
        key = (channel, microbatch)
        with self._cond:
            slot = self._slots.get(key)
            if not slot:
                return Mailbox.EMPTY
            value = slot.popleft()
            if not slot:
                del self._slots[key]
            return value

    def clear(self) -> None:
        """Drop every pending value and the recorded failure (after a failed step)."""
        with self._cond:
            self._slots.clear()
            self._error = None
