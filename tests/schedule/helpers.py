"""Shared helpers of the schedule tests: grids of sizes, hand-made schedules."""

from __future__ import annotations

from collections.abc import Iterator

from pipetrain.schedule import Action, Costs, Op, Schedule, SimulationResult, parse_actions

NUM_RANKS = range(1, 9)
NUM_MICROBATCHES = range(1, 17)
UNIFORM = Costs(forward=1, backward_input=1, backward_weight=1)
"""F = I = W = 1 (B = I + W = 2): the zero-bubble papers' analysis costs."""


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


def idle_inside(result: SimulationResult) -> tuple[float, ...]:
    """Per rank, the idle time between its first action's start and its last one's end
    (the bubble a rank has once it started, without the wait for its first input)."""
    spans = []
    for r in range(result.num_ranks):
        mine = [t for t in result.timeline if t.rank == r and t.action.op.is_compute]
        spans.append(max(t.end for t in mine) - min(t.start for t in mine) - result.busy[r])
    return tuple(spans)


def back_to_back(schedule: Schedule, steps: int) -> Schedule:
    """``steps`` training steps run one after the other with nothing between them (no
    optimizer step synchronizing the ranks): step ``s`` renames micro-batch ``i`` to
    ``s * M + i``."""
    m = schedule.num_microbatches
    return Schedule(
        name=f"{schedule.name} x{steps}",
        num_microbatches=steps * m,
        stage_to_rank=schedule.stage_to_rank,
        actions=tuple(
            tuple(Action(a.stage, a.op, s * m + a.microbatch) for s in range(steps) for a in acts
                  if a.microbatch is not None)
            for acts in schedule.actions
        ),
    )


def assert_each_w_after_its_i(schedule: Schedule) -> None:
    """Every W on the rank (and after the I) of its stage and micro-batch."""
    for actions in schedule.actions:
        done = set()
        for a in actions:
            if a.op is Op.BACKWARD_INPUT:
                done.add((a.stage, a.microbatch))
            elif a.op is Op.BACKWARD_WEIGHT:
                assert (a.stage, a.microbatch) in done, f"{a} before its I"
