"""Asynchronous pipelines as a stream: windows of admitted micro-batches, then a drain.

PipeDream and PipeDream-2BW never flush: micro-batches stream through the stages and
each stage updates its weights while others are still in flight. :class:`AsyncStream`
generates that stream one *window* at a time: ``window(n)`` admits the next ``n``
micro-batches (global numbering, ``i`` counts from the start of training) and returns,
per rank, the forwards of those micro-batches and the backwards (and optimizer steps)
that interleave with them; the micro-batches still in flight stay for the next window.
``drain()`` runs their backwards (a flush). A training step of
:class:`~pipetrain.api.pipeline.Pipeline` runs one window; the finite schedules of
:func:`~pipetrain.schedule.pipedream.pipedream` and :func:`~pipetrain.schedule.two_bw.two_bw`
are windows followed by the drain.

The order on every replica is 1F1B-RR: a replica of stage ``j`` (``r_j`` replicas,
micro-batch ``i`` on replica ``i % r_j``) admits ``w_j = ceil(sum(r_l, l > j) / r_j)``
forwards, then alternates one forward and one backward (PipeDream's NOAM on the input
stage is ``w_0 + 1``). Every action carries the weight version it uses (``F``/``B``) or
produces (``STEP``); a backward uses its forward's version (weight stashing):

- ``pipedream``: after each backward, the stage applies its update (``STEP``; with
  replicas a ``REDUCE`` first: one update per round of ``r_j`` micro-batches, one per
  replica). A forward uses the stage's newest weights; with ``vertical_sync`` it uses the
  version the input stage used for that micro-batch (uniform replica counts only).
- ``2bw``: gradients accumulate over a step's micro-batches; after the backward of its
  last micro-batch of the step, each stage applies the update. Every micro-batch of step
  ``t`` uses version ``max(t - 1, 0)``: ``W(t+1) = W(t) - lr * grad(W(t-1))``.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule
from pipetrain.schedule.replicated import replica_ranks

__all__ = ["ASYNC_SCHEDULES", "AsyncStream", "RankActions"]

ASYNC_SCHEDULES = ("pipedream", "2bw")
"""The asynchronous schedules (no flush, weight versions)."""

RankActions = list[list[Action]]
"""Per rank, an action list."""


@dataclass
class _Replica:
    stage: int
    rank: int
    index: int
    warmup: int
    updates: int = 0
    """Optimizer steps run: the version of its live weights."""
    pending: deque[int] = field(default_factory=deque)
    """Own micro-batches forwarded whose backward has not run, oldest first."""
    versions: dict[int, int] = field(default_factory=dict)
    """Version of each pending micro-batch's forward."""


class AsyncStream:
    """The stream of an asynchronous schedule over stages with ``replicas[j]`` ranks each.

    Example (two stages; the second window continues the first one's micro-batches):
        >>> from pipetrain.schedule.actions import format_actions
        >>> stream = AsyncStream("pipedream", [1, 1])
        >>> first, second = stream.window(2), stream.window(2)
        >>> format_actions(first[0]), format_actions(second[0])
        ('0F0v0 0F1v0 0B0v0 0STEPv1', '0F2v1 0B1v0 0STEPv2 0F3v2 0B2v1 0STEPv3')
        >>> format_actions(stream.drain()[0])
        '0B3v2 0STEPv4'

    Raises:
        ValueError: an unknown kind, a count below 1, ``vertical_sync`` with ``2bw`` or
            with replica counts that differ.
    """

    def __init__(self, kind: str, replicas: Sequence[int], *, vertical_sync: bool = False) -> None:
        if kind not in ASYNC_SCHEDULES:
            raise ValueError(f"unknown asynchronous schedule {kind!r}; choose one of "
                             f"{', '.join(ASYNC_SCHEDULES)}")
        if not replicas:
            raise ValueError(f"{kind}: replicas must list one count per stage, got none")
        check_counts({f"replicas[{j}]": (r, 1) for j, r in enumerate(replicas)}, context=kind)
        if vertical_sync and kind != "pipedream":
            raise ValueError(f"vertical_sync is an option of 'pipedream', not of {kind!r} (2BW "
                             "gives every stage the same version already); fix: vertical_sync=False")
        if vertical_sync and len(set(replicas)) > 1:
            raise ValueError(
                f"pipedream with vertical_sync needs the same replica count on every stage, got "
                f"{list(replicas)}: a version counts updates of a round of replicas, and rounds of "
                "different sizes do not line up; fix: uniform replicas, or vertical_sync=False")
        self.kind = kind
        self.replicas = tuple(replicas)
        self.vertical_sync = vertical_sync
        self.groups = replica_ranks(self.replicas)
        self._replicas = [
            _Replica(stage=j, rank=r, index=k,
                     warmup=math.ceil(sum(self.replicas[j + 1:]) / self.replicas[j]))
            for j, group in enumerate(self.groups) for k, r in enumerate(group)
        ]
        self.admitted = 0
        """Micro-batches admitted so far: the global index of the next one."""
        self.num_batches = 0
        """Windows (training steps) admitted so far."""
        self._input_versions: dict[int, int] = {}
        self._batch_ends: deque[int] = deque()

    @property
    def num_ranks(self) -> int:
        """Ranks of the stream (every replica of every stage)."""
        return len(self._replicas)

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline."""
        return len(self.replicas)

    @property
    def in_flight(self) -> bool:
        """Whether a micro-batch is forwarded somewhere and its backward has not run."""
        return any(rep.pending for rep in self._replicas)

    def minimum_count(self) -> int:
        """The fewest micro-batches a window may admit: a round of every stage's replicas;
        ``2bw`` also needs ``r_j * w_j`` on every stage (``K - 1`` with one rank per stage),
        so that a step's micro-batches reach a stage only after the previous step's are
        all there (else a step would start before its version exists, and a stage would
        keep three versions)."""
        rounds = max(self.replicas)
        if self.kind == "pipedream":
            return rounds
        return max(rounds, *(self.replicas[rep.stage] * rep.warmup for rep in self._replicas))

    def count_problem(self, count: int) -> str:
        """Why a window of ``count`` micro-batches cannot run, or ``""``."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return f"{self.kind} needs a positive number of micro-batches per step, got {count!r}"
        uneven = sorted({r for r in self.replicas if count % r})
        if uneven:
            return (f"{self.kind} with stage replicas {list(self.replicas)} needs each step's "
                    f"micro-batch count to be a multiple of every replica count (the replicas of "
                    f"a stage update together, once per round), got {count}; fix: a multiple of "
                    f"{math.lcm(*self.replicas)}")
        least = self.minimum_count()
        if count < least:
            return (f"{self.kind} needs at least {least} micro-batches per step on "
                    f"{self.num_stages} stages (replicas {list(self.replicas)}): with fewer, "
                    f"a step would reach a stage before the version it uses exists, and the "
                    f"stage would keep three weight versions, not two; got {count}; fix: "
                    f"num_microbatches >= {least}")
        return ""

    # -- windows ------------------------------------------------------------------------
    def window(self, count: int) -> RankActions:
        """Admit the next ``count`` micro-batches; per rank, what it runs meanwhile.

        Raises:
            ValueError: see :meth:`count_problem`.
        """
        problem = self.count_problem(count)
        if problem:
            raise ValueError(problem)
        first, batch = self.admitted, self.num_batches
        oldest = min((rep.pending[0] for rep in self._replicas if rep.pending), default=first)
        while self._batch_ends and self._batch_ends[0] <= oldest:
            self._batch_ends.popleft()  # every micro-batch of that step is done
        self._batch_ends.append(first + count)
        actions: RankActions = [[] for _ in self._replicas]
        for rep in self._replicas:
            size = self.replicas[rep.stage]
            out = actions[rep.rank]
            start = first + (rep.index - first) % size
            for i in range(start, first + count, size):
                version = self._forward_version(rep, i, batch)
                out.append(Action(rep.stage, Op.FORWARD, i, version))
                rep.pending.append(i)
                rep.versions[i] = version
                if len(rep.pending) > rep.warmup:
                    self._backward(rep, out)
        self.admitted += count
        self.num_batches += 1
        return actions

    def drain(self) -> RankActions:
        """The backwards (and updates) of every micro-batch in flight: a flush."""
        actions: RankActions = [[] for _ in self._replicas]
        for rep in self._replicas:
            while rep.pending:
                self._backward(rep, actions[rep.rank])
        self._input_versions.clear()
        return actions

    def next_forward_versions(self, count: int) -> list[int | None]:
        """Per rank, the version the first forward of a next window of ``count`` would use
        (``None``: no forward), without admitting anything."""
        ahead = copy.deepcopy(self)
        found: list[int | None] = [None] * self.num_ranks
        for r, actions in enumerate(ahead.window(count)):
            found[r] = next((a.version for a in actions if a.op is Op.FORWARD), None)
        return found

    def schedule(self, count: int, *, num_steps: int = 1) -> Schedule:
        """``num_steps`` windows of ``count`` micro-batches and the drain, as a schedule.

        Example:
            >>> print(AsyncStream("2bw", [1]).schedule(1, num_steps=3))
            rank 0: 0F0v0 0B0v0 0STEPv1 0F1v0 0B1v0 0STEPv2 0F2v1 0B2v1 0STEPv3
        """
        check_counts({"num_steps": (num_steps, 1)}, context=self.kind)
        actions = [self.window(count) for _ in range(num_steps)] + [self.drain()]
        return Schedule(
            name=self.kind,
            num_microbatches=count * num_steps,
            stage_to_rank=tuple(group[0] for group in self.groups),
            actions=tuple(tuple(a for part in actions for a in part[r]) for r in range(self.num_ranks)),
            replicas=self.groups if max(self.replicas) > 1 else (),
        )

    def updates(self, stage: int) -> int:
        """The updates ``stage`` has run so far in this stream (its live version)."""
        return next(rep.updates for rep in self._replicas if rep.stage == stage)

    def restart(self, *, admitted: int, num_batches: int) -> None:
        """Continue after ``num_batches`` steps of ``admitted`` micro-batches in all, run
        and drained elsewhere (a checkpoint): the stages' versions follow from them.

        Example:
            >>> stream = AsyncStream("pipedream", [2, 1])
            >>> stream.restart(admitted=8, num_batches=2)
            >>> stream.updates(0), stream.updates(1), stream.window(2)[2][0]
            (4, 8, Action(1F8v8))
        """
        if self.in_flight:
            raise RuntimeError("restart() needs a drained stream (micro-batches are in flight)")
        self.admitted, self.num_batches = admitted, num_batches
        for rep in self._replicas:
            rep.updates = num_batches if self.kind == "2bw" else admitted // self.replicas[rep.stage]
        self._input_versions.clear()
        self._batch_ends.clear()

    # -- versions -----------------------------------------------------------------------
    def _forward_version(self, rep: _Replica, i: int, batch: int) -> int:
        if self.kind == "2bw":
            version = max(batch - 1, 0)
            assert version <= rep.updates, "2bw: the version a step uses exists (minimum_count)"
            return version
        if not self.vertical_sync or rep.stage == 0:
            if self.vertical_sync:
                self._input_versions[i] = rep.updates
            return rep.updates
        if rep.stage == self.num_stages - 1:
            return self._input_versions.pop(i)
        return self._input_versions[i]

    def _backward(self, rep: _Replica, out: list[Action]) -> None:
        i = rep.pending.popleft()
        out.append(Action(rep.stage, Op.BACKWARD, i, rep.versions.pop(i)))
        size = self.replicas[rep.stage]
        if self.kind == "2bw":
            end = self._batch_ends[bisect.bisect_right(self._batch_ends, i)]
            if i + size < end:
                return  # not this replica's last micro-batch of the step
        if size > 1:
            out.append(Action(rep.stage, Op.REDUCE_GRAD))
        rep.updates += 1
        out.append(Action(rep.stage, Op.OPTIMIZER_STEP, None, rep.updates))
