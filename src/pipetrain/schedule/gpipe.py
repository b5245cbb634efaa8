"""GPipe's fill-drain schedule: every forward, then every backward."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int, *, last_first: bool = False) -> Schedule:
    """GPipe (Huang et al., 2019): stage ``j`` runs ``F0 .. F(M-1)``, then ``B0 .. B(M-1)``
    (``last_first``: ``B(M-1) .. B0``, torchgpipe's order, in which the micro-batch whose
    forward ran last is the first to free its activations).

    One stage per rank. Every stage holds the activations of all ``M`` micro-batches at
    the turn; the bubble is ``(K-1)/(M+K-1)`` of the time with uniform costs.

    Example (one column per clock tick, unit costs):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(gpipe(3, 4)))
        rank 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
        rank 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3
        rank 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3
        >>> print(render_grid(gpipe(2, 3, last_first=True)))
        rank 0: F0 F1 F2 .  .  B2 B1 B0
        rank 1: .  F0 F1 F2 B2 B1 B0

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
        context="gpipe",
    )
    order = range(num_microbatches - 1, -1, -1) if last_first else range(num_microbatches)
    actions = [
        [Action(j, Op.FORWARD, i) for i in range(num_microbatches)]
        + [Action(j, Op.BACKWARD, i) for i in order]
        for j in range(num_stages)
    ]
    return Schedule(
        name="gpipe",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(num_stages)),
        actions=tuple(tuple(acts) for acts in actions),
    )
