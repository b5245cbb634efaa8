"""Shared helpers of the schedule tests: grids of sizes, hand-made schedules."""

from __future__ import annotations

from collections.abc import Iterator

from pipetrain.schedule import Op, Schedule, parse_actions

NUM_RANKS = range(1, 9)
NUM_MICROBATCHES = range(1, 17)


def sizes(*, min_microbatches_per_rank: int = 0) -> Iterator[tuple[int, int]]:
    """Every (K, M) of the validator grid, K in 1..8, M in 1..16 (M >= K * the minimum)."""
    for num_ranks in NUM_RANKS:
        for num_microbatches in NUM_MICROBATCHES:
            if num_microbatches >= num_ranks * min_microbatches_per_rank:
                yield num_ranks, num_microbatches


def make(
    *rank_lists: str, stage_to_rank: tuple[int, ...] | None = None, num_microbatches: int = 1
) -> Schedule:
    """A schedule from compact action lists, one string per rank."""
    return Schedule(
        name="hand-made",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(len(rank_lists))) if stage_to_rank is None else stage_to_rank,
        actions=tuple(tuple(parse_actions(text)) for text in rank_lists),
    )


def full_activation_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most micro-batches whose F ran and whose B or I (input backward) has not."""
    peaks = []
    for actions in schedule.actions:
        held = peak = 0
        for a in actions:
            if a.op is Op.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)
