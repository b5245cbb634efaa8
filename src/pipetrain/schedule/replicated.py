"""Replicated stages: several ranks per stage, micro-batches round-robin over them.

PipeDream's plans give each stage its own number of workers (VGG-16 as "15-1"): stage
``j`` has ``r_j`` replicas, and micro-batch ``i`` of stage ``j`` runs on replica
``i % r_j`` (1F1B-RR). Ranks are numbered stage by stage: stage 0's replicas first.

- :func:`replicated_pipeline` generates GPipe, 1F1B or forward-only for any replica
  counts. A replica of stage ``j`` runs its own micro-batches in order; under 1F1B it
  first runs ``ceil(sum(r_l for l > j) / r_j)`` forwards (the micro-batches in flight
  below it, shared among its replicas; with one replica per stage this is 1F1B's
  ``K - j - 1``), then alternates one forward and one backward.
- :func:`uniform_replicas` turns any one-replica schedule (interleaved and zero-bubble
  included) into ``D`` copies of it, one per replica, micro-batch ``i`` of copy ``d``
  becoming global micro-batch ``i * D + d`` (the same round-robin).

With ``r_j = D`` for every stage both give the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["REPLICATED_SCHEDULES", "replica_ranks", "replicated_pipeline", "uniform_replicas"]

REPLICATED_SCHEDULES = ("gpipe", "1f1b", "forward")
"""The schedules :func:`replicated_pipeline` generates for any replica counts."""


def replica_ranks(replicas: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each stage's replicas, stage by stage.

    Example:
        >>> replica_ranks([2, 1, 3])
        ((0, 1), (2,), (3, 4, 5))
    """
    groups, start = [], 0
    for count in replicas:
        groups.append(tuple(range(start, start + count)))
        start += count
    return tuple(groups)


def _check(replicas: Sequence[int], num_microbatches: int, context: str, *, training: bool) -> None:
    if not replicas:
        raise ValueError(f"{context}: replicas must list one count per stage, got none")
    counts = {f"replicas[{j}]": (r, 1) for j, r in enumerate(replicas)}
    check_counts({**counts, "num_microbatches": (num_microbatches, 1)}, context=context)
    short = [j for j, r in enumerate(replicas) if r > num_microbatches]
    if short and training:
        raise ValueError(
            f"{context}: stage(s) {short} have more replicas than the {num_microbatches} "
            f"micro-batches of a step (a replica would get none); fix: num_microbatches >= "
            f"{max(replicas)}, or fewer replicas"
        )


def _replica_actions(name: str, j: int, mine: list[int], warmup: int) -> list[Action]:
    if name == "forward":
        return [Action(j, Op.FORWARD, i) for i in mine]
    if name == "gpipe":
        return [Action(j, Op.FORWARD, i) for i in mine] + [Action(j, Op.BACKWARD, i) for i in mine]
    warmup = min(warmup, len(mine))
    actions = [Action(j, Op.FORWARD, i) for i in mine[:warmup]]
    for t, i in enumerate(mine[warmup:]):
        actions += [Action(j, Op.FORWARD, i), Action(j, Op.BACKWARD, mine[t])]
    actions += [Action(j, Op.BACKWARD, i) for i in mine[len(mine) - warmup:]]
    return actions


def replicated_pipeline(name: str, replicas: Sequence[int], num_microbatches: int) -> Schedule:
    """GPipe, 1F1B or forward-only over stages with ``replicas[j]`` ranks each.

    Example (stage 0 on two ranks, stage 1 on one; one column per tick):
        >>> from pipetrain.schedule.grid import render_grid
        >>> s = replicated_pipeline("1f1b", [2, 1], 4)
        >>> s.replicas, s.num_ranks
        (((0, 1), (2,)), 3)
        >>> print(render_grid(s))
        rank 0: 0F0 0F2 .   0B0 .   .   .   0B2
        rank 1: 0F1 0F3 .   .   .   0B1 .   .   .   0B3
        rank 2: .   1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

    Raises:
        ValueError: an unknown schedule, a count below 1, or (training) a stage with more
            replicas than micro-batches: a replica would have no gradient to reduce.
    """
    if name not in REPLICATED_SCHEDULES:
        raise ValueError(
            f"schedule {name!r} cannot run replicated stages with different replica counts; "
            f"choose one of {', '.join(REPLICATED_SCHEDULES)} (or give every stage the same "
            f"number of replicas)"
        )
    _check(replicas, num_microbatches, f"{name} with replicas {list(replicas)}",
           training=name != "forward")
    groups = replica_ranks(replicas)
    actions: list[tuple[Action, ...]] = []
    for j, group in enumerate(groups):
        below = sum(replicas[j + 1:])
        warmup = math.ceil(below / replicas[j])
        for k in range(len(group)):
            mine = list(range(k, num_microbatches, len(group)))
            actions.append(tuple(_replica_actions(name, j, mine, warmup)))
    return Schedule(
        name=name,
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(group[0] for group in groups),
        actions=tuple(actions),
        replicas=groups,
    )


def uniform_replicas(
    build: Callable[[int], Schedule], num_microbatches: int, num_replicas: int
) -> Schedule:
    """``num_replicas`` copies of a one-replica schedule, one per data-parallel replica.

    Replica ``d`` runs micro-batches ``d, d + D, d + 2D, ...`` of the ``num_microbatches``:
    ``build(n)`` makes the one-replica schedule of its ``n`` micro-batches, and rank
    ``p * D + d`` runs rank ``p``'s actions of it, micro-batch ``i`` renamed ``i * D + d``.
    A replica left without a micro-batch (a small evaluation batch) runs nothing; in a
    training schedule every replica needs one.

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> s = uniform_replicas(lambda n: gpipe(2, n), 4, 2)
        >>> print(s)
        rank 0: 0F0 0F2 0B0 0B2
        rank 1: 0F1 0F3 0B1 0B3
        rank 2: 1F0 1F2 1B0 1B2
        rank 3: 1F1 1F3 1B1 1B3
        >>> s.rank_of(1, 3)
        3
    """
    check_counts({"num_replicas": (num_replicas, 1), "num_microbatches": (num_microbatches, 1)},
                 context="uniform_replicas")
    d_count = num_replicas
    copies = [build(len(range(d, num_microbatches, d_count))) if d < num_microbatches else None
              for d in range(d_count)]
    first = copies[0]
    assert first is not None
    if first.replicas:
        raise ValueError(f"schedule {first.name!r} is replicated already")
    if d_count == 1:
        return first
    if num_microbatches < d_count and first.is_training:
        raise ValueError(
            f"{num_microbatches} micro-batches cannot train {d_count} replicas (replica "
            f"{num_microbatches} would get none); fix: at least {d_count} micro-batches"
        )
    actions: list[tuple[Action, ...]] = []
    for p in range(first.num_ranks):
        for d, copy in enumerate(copies):
            acts = () if copy is None else copy.actions[p]
            actions.append(tuple(
                a if a.microbatch is None else Action(a.stage, a.op, a.microbatch * d_count + d, a.version)
                for a in acts
            ))
    groups = tuple(tuple(r * d_count + d for d in range(d_count)) for r in first.stage_to_rank)
    return Schedule(
        name=first.name,
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(group[0] for group in groups),
        actions=tuple(actions),
        replicas=groups,
    )
