"""The forward-only schedule, for evaluation and inference: no backward, nothing held."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule, loop_placement

__all__ = ["forward_only"]


def forward_only(
    num_stages: int,
    num_microbatches: int,
    *,
    stages_per_rank: int = 1,
    stage_to_rank: Sequence[int] | None = None,
) -> Schedule:
    """Every stage runs ``F0 .. F(M-1)``; ``num_stages`` counts every stage.

    With ``stages_per_rank = V`` the ``num_stages / V`` ranks hold their stages looped
    (stage ``j`` on rank ``j % (num_stages / V)``, as interleaved 1F1B) and run them one
    after the other, all micro-batches each. ``stage_to_rank`` places the stages
    otherwise (the V of ``zb-v``, a user schedule's placement): each rank still runs its
    stages in increasing order, which is deadlock-free for any placement.

    Example (one column per clock tick, unit costs):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(forward_only(2, 3)))
        rank 0: F0 F1 F2
        rank 1: .  F0 F1 F2
        >>> print(render_grid(forward_only(4, 2, stages_per_rank=2)))
        rank 0: 0F0 0F1 2F0 2F1
        rank 1: .   1F0 1F1 3F0 3F1
        >>> print(render_grid(forward_only(4, 2, stages_per_rank=2, stage_to_rank=(0, 1, 1, 0))))
        rank 0: 0F0 0F1 .   .   3F0 3F1
        rank 1: .   1F0 1F1 2F0 2F1

    Raises:
        ValueError: a count is below 1, ``num_stages`` is not a multiple of
            ``stages_per_rank``, or ``stage_to_rank`` does not give every stage a rank
            ``0 <= r < num_stages / stages_per_rank``.
    """
    check_counts(
        {
            "num_stages": (num_stages, 1),
            "num_microbatches": (num_microbatches, 1),
            "stages_per_rank": (stages_per_rank, 1),
        },
        context="forward",
    )
    num_ranks, rest = divmod(num_stages, stages_per_rank)
    if rest:
        raise ValueError(
            f"forward: num_stages={num_stages} is not a multiple of "
            f"stages_per_rank={stages_per_rank}; use num_stages={(num_ranks + 1) * stages_per_rank}"
        )
    if stage_to_rank is None:
        stage_to_rank = loop_placement(num_ranks, stages_per_rank)
    elif len(stage_to_rank) != num_stages or not set(stage_to_rank) <= set(range(num_ranks)):
        raise ValueError(
            f"forward: stage_to_rank {tuple(stage_to_rank)} must give each of the "
            f"{num_stages} stages one of the ranks 0..{num_ranks - 1}"
        )
    return Schedule(
        name="forward",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(
            tuple(
                Action(j, Op.FORWARD, i)
                for j in range(num_stages)
                if stage_to_rank[j] == r
                for i in range(num_microbatches)
            )
            for r in range(num_ranks)
        ),
    )
