"""PipeDream-Flush (1F1B): warm up with forwards, then alternate one forward, one backward."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["one_f_one_b"]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., 2021): the memory-bounded fill-drain.

    Stage ``j`` runs ``min(K-j-1, M)`` warm-up forwards, then alternates one forward and
    one backward, then drains the remaining backwards. It never holds more than
    ``min(K-j, M)`` micro-batches (GPipe: ``M``) and has GPipe's bubble.

    Example (one column per clock tick, unit costs):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(one_f_one_b(3, 4)))
        rank 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        rank 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3
        rank 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
        context="1f1b",
    )
    return Schedule(
        name="1f1b",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(num_stages)),
        actions=tuple(
            tuple(_stage_actions(j, num_stages, num_microbatches)) for j in range(num_stages)
        ),
    )


def _stage_actions(j: int, num_stages: int, num_microbatches: int) -> list[Action]:
    num_warmup = min(num_stages - j - 1, num_microbatches)
    actions = [Action(j, Op.FORWARD, i) for i in range(num_warmup)]
    for i in range(num_microbatches - num_warmup):
        actions += [Action(j, Op.FORWARD, num_warmup + i), Action(j, Op.BACKWARD, i)]
    actions += [
        Action(j, Op.BACKWARD, i) for i in range(num_microbatches - num_warmup, num_microbatches)
    ]
    return actions
