"""Interleaved 1F1B (Megatron-LM): several virtual stages per rank, looped placement."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule, loop_placement

__all__ = ["interleaved_1f1b", "microbatch_groups"]


def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2
) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021): ``V`` stages per rank, ``j`` on ``j % K``.

    Micro-batches go in groups (see :func:`microbatch_groups`); each rank runs the
    forwards of a group on its first stage, then on its second, ..., then the next
    group; backwards go in the same order with the stages reversed. Rank ``r`` warms
    up with ``(V-1)*G + 2*(K-1-r)`` forwards (``G`` the first group's size), then
    alternates one forward and one backward, then drains the backwards. With ``M`` a
    multiple of ``K`` (groups of ``K``, as Megatron-LM) and uniform costs the bubble
    time is 1F1B's divided by ``V``. Any ``M >= K`` works: when ``K`` does not divide
    ``M``, the ``M // K`` groups differ in size by at most one, larger first.

    Example (one column per clock tick, unit costs; cells name the stage):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(interleaved_1f1b(2, 2)))
        rank 0: 0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1
        rank 1: .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1

    Raises:
        ValueError: ``num_ranks < 1``, ``stages_per_rank < 2`` or
            ``num_microbatches < num_ranks``.
    """
    check_counts(
        {
            "num_ranks": (num_ranks, 1),
            "num_microbatches": (num_microbatches, 1),
            "stages_per_rank": (stages_per_rank, 2),
        },
        context="interleaved-1f1b",
    )
    if num_microbatches < num_ranks:
        raise ValueError(
            f"interleaved-1f1b needs at least num_ranks micro-batches: got "
            f"num_microbatches={num_microbatches} for num_ranks={num_ranks}; use "
            f"num_microbatches={num_ranks} (or a multiple of it, e.g. {2 * num_ranks})"
        )
    groups = microbatch_groups(num_microbatches, num_ranks)
    order = []  # (virtual stage v on the rank, micro-batch i) in forward order
    first = 0
    for size in groups:
        order += [(v, i) for v in range(stages_per_rank) for i in range(first, first + size)]
        first += size
    total = len(order)
    actions = []
    for r in range(num_ranks):
        forwards = [Action(v * num_ranks + r, Op.FORWARD, i) for v, i in order]
        backwards = [
            Action((stages_per_rank - 1 - v) * num_ranks + r, Op.BACKWARD, i) for v, i in order
        ]
        num_warmup = min((stages_per_rank - 1) * groups[0] + 2 * (num_ranks - 1 - r), total)
        rank_actions = forwards[:num_warmup]
        for k in range(total - num_warmup):
            rank_actions += [forwards[num_warmup + k], backwards[k]]
        rank_actions += backwards[total - num_warmup :]
        actions.append(tuple(rank_actions))
    return Schedule(
        name="interleaved-1f1b",
        num_microbatches=num_microbatches,
        stage_to_rank=loop_placement(num_ranks, stages_per_rank),
        actions=tuple(actions),
    )


def microbatch_groups(num_microbatches: int, num_ranks: int) -> tuple[int, ...]:
    """Sizes of the micro-batch groups: ``M // K`` groups of ``K`` to ``2K-1``, larger first.

    Every group has at least ``K`` micro-batches, so that a rank's first stage never
    waits for its own micro-batch to come back round the ring, and the first group is
    the largest, so that the warm-up (sized by it) covers every later group.

    Example:
        >>> microbatch_groups(8, 4), microbatch_groups(5, 2), microbatch_groups(14, 4)
        ((4, 4), (3, 2), (5, 5, 4))
    """
    num_groups = num_microbatches // num_ranks
    base, extra = divmod(num_microbatches, num_groups)
    return (base + 1,) * extra + (base,) * (num_groups - extra)
