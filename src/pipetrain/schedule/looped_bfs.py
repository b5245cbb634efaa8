"""Looped BFS (Lamy-Poirier): breadth-first over virtual stages, looped placement."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule, loop_placement

__all__ = ["looped_bfs"]


def looped_bfs(num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2) -> Schedule:
    """Breadth-first pipeline parallelism (Lamy-Poirier, 2022), looped placement.

    ``V`` stages per rank, stage ``j`` on rank ``j % K`` (as interleaved 1F1B). Each
    rank runs its stages one after the other, every micro-batch of a stage before the
    next stage: the forwards of its first stage on ``F0 .. F(M-1)``, then of its
    second, ...; then the backwards, last stage first, each stage on ``B(M-1) .. B0``
    (the last forward's backward first, as GPipe's ``except_last`` expects). It is GPipe
    run ``V`` times round the ring: with ``M >= K`` a rank never waits for its next
    stage's first micro-batch, and with uniform costs the bubble time is GPipe's
    divided by ``V`` (each stage being ``1/V`` of a rank's work), at the price of
    holding every micro-batch of every stage, ``V * M`` per rank, until the backward.

    Example (one column per clock tick, unit costs; cells name the stage):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(looped_bfs(2, 2)))
        rank 0: 0F0 0F1 2F0 2F1 .   .   2B1 2B0 0B1 0B0
        rank 1: .   1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0

    Raises:
        ValueError: a count is below 1 or ``stages_per_rank`` below 2 (one stage per
            rank is GPipe: use ``gpipe``).
    """
    check_counts(
        {
            "num_ranks": (num_ranks, 1),
            "num_microbatches": (num_microbatches, 1),
            "stages_per_rank": (stages_per_rank, 2),
        },
        context="looped-bfs",
    )
    microbatches = range(num_microbatches)
    actions = []
    for r in range(num_ranks):
        own = range(r, num_ranks * stages_per_rank, num_ranks)
        actions.append(
            tuple(Action(j, Op.FORWARD, i) for j in own for i in microbatches)
            + tuple(Action(j, Op.BACKWARD, i) for j in reversed(own) for i in reversed(microbatches))
        )
    return Schedule(
        name="looped-bfs",
        num_microbatches=num_microbatches,
        stage_to_rank=loop_placement(num_ranks, stages_per_rank),
        actions=tuple(actions),
    )
