"""Shared re-materialization: idle stage workers rebuild other stages' checkpointed graphs.

When the stages of a single-process pipeline share the CPU, the backward phase leaves
the stage workers idle: the caller's thread runs the stages' backwards one after another,
each preceded by the recomputation of a checkpointed micro-batch. A recomputation is a
pure function of what the stage kept (its input and its random stream), so any thread can
run it. :class:`RecomputeSharing` lets a worker that would otherwise wait rebuild the
graph that some stage will need next, taking the recomputation off the backward's path.

Memory stays bounded: a helper rebuilds a graph for a stage only while that stage holds
fewer than ``limit`` micro-batches' graphs (kept from forward, rebuilt, or in backward;
:meth:`~pipetrain.runtime.stage.StageCompute.graphs_held`). The owner itself never waits
for room. Every graph rebuilt ahead is memory that recomputing right before each backward
(torchgpipe's way, and pipetrain's default) does not hold, hence opt-in.

A CPU tuning: :class:`~pipetrain.runtime.cpu_tuning.CpuTuning` sets it up for the CPU
partitions of a ``GPipe`` that asks for ``recompute_ahead >= 1`` (it sets ``limit - 1``);
a pipeline on GPUs never uses it.

Locking: every bookkeeping step runs under ``cond``, the condition of the transport's
mailbox, so a worker waiting there for a message is also woken when work to help with
appears, with no lost wake-up in between. Recomputations run without the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


class SharedStage(Protocol):
    """What sharing needs of a stage (:class:`~pipetrain.runtime.stage.StageCompute`)."""

    stage_index: int

    @property
    def touches_generators(self) -> bool: ...

    def pending_recomputations(self) -> list[int]: ...

    def graphs_held(self) -> int: ...

    def rebuild(self, microbatch: int) -> None: ...

__all__ = ["RecomputeSharing", "SharedStage"]


@dataclass
class _StageBook:
    """Claims on one stage's checkpointed micro-batches (keys) during an open run."""

    claimed: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    errors: dict[int, BaseException] = field(default_factory=dict)

    def clear(self) -> None:
        self.claimed.clear()
        self.done.clear()
        self.errors.clear()


class RecomputeSharing:
    """Idle workers of one process run the recomputations other stages will need next.

    ``stages`` are the stages whose recomputation may move to another thread (stages on
    the CPU); ``helpers`` are the threads allowed to help (their workers); ``cond`` is the
    lock shared with the mailbox those threads wait in. Sharing is active between
    :meth:`open` and :meth:`close` (one backward phase).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from pipetrain.runtime.stage import StageCompute
        >>> stage = StageCompute(nn.Linear(2, 2), stage_index=0, device=torch.device("cpu"))
        >>> cond = threading.Condition()
        >>> sharing = RecomputeSharing([stage], cond, helpers=[threading.get_ident()])
        >>> stage.sharing = sharing
        >>> _ = stage.forward(0, torch.ones(1, 2), checkpointed=True)
        >>> sharing.open(0, 1)
        >>> with cond:
        ...     sharing.help()          # this thread rebuilds micro-batch 0's graph
        True
        >>> grads = stage.backward(0, [torch.ones(1, 2)])   # no second recomputation
        >>> sharing.close()
    """

    def __init__(self, stages: Iterable[SharedStage], cond: threading.Condition, *,
                 helpers: Iterable[int], limit: int = 2, timeout: float = 300.0) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1 re-materialized graph, got {limit}")
        # later stages first: in a fill-drain backward their chain is the critical path
        self.stages = sorted(stages, key=lambda s: -s.stage_index)
        self.cond = cond
        self.helpers = frozenset(helpers)
        self.limit = limit
        self.timeout = timeout
        self._books: dict[int, _StageBook] = {id(s): _StageBook() for s in self.stages}
        self._range: tuple[int, int] | None = None
        self._running = 0
        self._speculating = False
        self._generation = 0
        """counts speculations: a helper of an earlier one must stop (its worker has
        the next forward queued behind it)"""
        self._ready: set[int] | None = None
        """while speculating: the stages whose forward phase is done (None: all)"""
        self.helped = 0
        """recomputations run by a thread other than their stage's owner (statistics)"""

    # -- the run ----------------------------------------------------------------------
    def open(self, low: int, high: int, *, tasks: int = 0) -> None:
        """Share the recomputation of micro-batch keys in ``[low, high)``; ``tasks`` is
        the number of worker tasks of the run (see :meth:`task_done`). Ends a
        speculation on the same keys, keeping its claims."""
        with self.cond:
            if self._range != (low, high):
                for book in self._books.values():
                    book.clear()
            self._range = (low, high)
            self._running = tasks
            self._speculating = False
            self._ready = None
            self.cond.notify_all()

    def speculate(self, low: int, high: int) -> int:
        """From a forward phase to its backward: workers that run
        :meth:`help_while_speculating` may start on keys ``[low, high)`` early, on the
        stages whose forward phase is done (:meth:`forward_done`; a stage's layers never
        run in two threads at once). :meth:`open` or :meth:`close` ends it. Returns the
        speculation's number, for :meth:`help_while_speculating`."""
        self.open(low, high)
        with self.cond:
            self._speculating = True
            self._ready = set()
            self._generation += 1
            return self._generation

    def forward_done(self, stage: SharedStage) -> None:
        """``stage`` ran its forward phase: its graphs may be rebuilt now."""
        with self.cond:
            if self._ready is not None:
                self._ready.add(id(stage))
                self.cond.notify_all()

    def help_while_speculating(self, generation: int) -> None:
        """Help until speculation number ``generation`` ends, or nothing is left that
        could be rebuilt."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while (self._speculating and self._generation == generation
                   and time.monotonic() < deadline):
                if self.help():
                    continue
                if not any(self._unclaimed(stage) for stage in self.stages
                           if not stage.touches_generators):
                    return  # all rebuilt or claimed (or the forward's output was dropped)
                self.cond.wait(1.0)

    def close(self) -> None:
        """Stop sharing (the run ended, or failed); waits for recomputations in progress."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            self._range = None
            self._speculating = False
            self._ready = None
            while any(book.claimed - book.done for book in self._books.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            for book in self._books.values():
                book.clear()
            self.cond.notify_all()

    @property
    def active(self) -> bool:
        return self._range is not None

    def task_done(self) -> None:
        """A worker's task of the run has finished (wakes the workers waiting to help)."""
        with self.cond:
            self._running -= 1
            self.cond.notify_all()

    def help_until_done(self, failed: Callable[[], object]) -> None:
        """Help while other tasks of the run are still going. ``failed()`` is checked
        under the lock: a truthy value (a recorded failure) ends the help at once."""
        with self.cond:
            while self.active and self._running > 0 and not failed():
                if not self.help():
                    self.cond.wait(1.0)

    # -- helping ----------------------------------------------------------------------
    def _unclaimed(self, stage: SharedStage) -> list[int]:
        """The stage's checkpointed keys of the run that nobody rebuilt or claimed."""
        assert self._range is not None
        low, high = self._range
        book = self._books[id(stage)]
        return sorted(k for k in stage.pending_recomputations()
                      if low <= k < high and k not in book.claimed)

    def _candidate(self) -> tuple[SharedStage, int] | None:
        for stage in self.stages:
            # while speculating, the caller's thread runs its own code (its loss), which
            # may draw from torch's generators: leave the stages that seed them alone
            if self._ready is not None and (id(stage) not in self._ready
                                            or stage.touches_generators):
                continue
            book = self._books[id(stage)]
            if stage.graphs_held() + len(book.claimed - book.done) >= self.limit:
                continue
            keys = self._unclaimed(stage)
            if keys:  # the latest: GPipe's backward runs last micro-batch first
                return stage, keys[-1]
        return None

    def help(self) -> bool:
        """Run one recomputation some stage will need; ``True`` if one ran.

        The caller holds :attr:`cond`; it is released while the recomputation runs.
        """
        if not self.active or threading.get_ident() not in self.helpers:
            return False
        found = self._candidate()
        if found is None:
            return False
        stage, key = found
        self._run(stage, key, helping=True)
        return True

    def _run(self, stage: SharedStage, key: int, *, helping: bool) -> None:
        """Claim ``key`` of ``stage`` and rebuild it without the lock (caller holds it)."""
        book = self._books[id(stage)]
        book.claimed.add(key)
        self.cond.release()
        try:
            stage.rebuild(key)
        except BaseException as error:  # re-raised by the owner's recompute
            book.errors[key] = error
        finally:
            self.cond.acquire()
            book.done.add(key)
            if helping:
                self.helped += 1
            self.cond.notify_all()

    # -- the owner --------------------------------------------------------------------
    def recompute(self, stage: SharedStage, key: int) -> None:
        """The owner needs ``key``'s graph now: rebuild it, or wait for its helper."""
        book = self._books[id(stage)]
        deadline = time.monotonic() + self.timeout
        with self.cond:
            if key not in book.claimed:
                self._run(stage, key, helping=False)
            while key not in book.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"stage {stage.stage_index}: waited {self.timeout:.0f} s for another "
                        f"worker to recompute micro-batch {key}"
                    )
                self.cond.wait(remaining)
            error = book.errors.pop(key, None)
        if error is not None:
            raise error

    def freed(self) -> None:
        """A stage freed a graph (a backward finished): there may be room to help now."""
        with self.cond:
            self.cond.notify_all()
