"""DualPipe-V (DeepSeek): V placement, each forward paired with another micro-batch's backward."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Op
from pipetrain.schedule.program import Schedule, v_placement
from pipetrain.schedule.rank_plan import RankPlan

__all__ = ["dualpipe_v"]

FWD, FULL, INPUT = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe-V: DeepSeek's DualPipe (DeepSeek-V3 report, 2024) cut in half onto a V.

    Placement as :func:`~pipetrain.schedule.zb_v.zb_v`: ``2K`` stages, rank ``r`` holds
    ``d = r`` (way down) and ``u = 2K-1-r`` (way up). The heart of the schedule is the
    *pair*: the forward of one micro-batch on one of the rank's stages right next to the
    full backward (``B``) of another micro-batch on its other stage, which DualPipe runs
    overlapped so that one's communication hides behind the other's compute. Here a pair
    is two adjacent actions of the rank's list (a scheduling order, not a fused kernel):
    the runtime runs them one after the other, and its background sends and receives
    overlap them as they overlap any action. Rank ``r`` runs:

    1. ``2(K-r-1)`` forwards of ``d``, then ``r+1`` times ``F(d) F(u)``;
    2. ``K-r-1`` times ``I(u) W F(u)`` (zero-bubble: a ``W`` owed fills the gap);
    3. steady state, ``M-2K+r+1`` times the two pairs ``F(d)+B(u)`` and ``F(u)+B(d)``;
    4. ``K-r-1`` times ``B(u)`` and the pair ``F(u)+B(d)``;
    5. ``r+1`` times ``B(u) B(d)``, from half-way on split into ``I`` (the ``W`` s wait);
    6. ``K-r-1`` times ``W`` and the next backward of ``d``; then the ``W`` s still owed.

    With ``F = I = W`` and ``B = I + W`` the bubble is ZB-V's, ``(K-1) / (6M+K-1)``;
    each rank holds at most ``2K+1`` stage-micro-batches (the DualPipe report's
    ``PP+1`` for DualPipe-V, ``PP = 2K`` its stages), one more than ZB-V. The shape
    needs ``M >= 2K``; with fewer micro-batches the schedule is the one for ``2K`` with
    the missing micro-batches left out.

    Example (one column per clock tick, unit costs; cells name the stage):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(dualpipe_v(2, 4)))
        rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        rank 1: .   1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3

    Raises:
        ValueError: ``num_ranks`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_ranks": (num_ranks, 1), "num_microbatches": (num_microbatches, 1)},
        context="dualpipe-v",
    )
    k, m = num_ranks, max(num_microbatches, 2 * num_ranks)
    actions = []
    for r in range(k):
        down, up = r, 2 * k - 1 - r
        plan = RankPlan(num_microbatches)
        plan.run([(down, FWD)] * (2 * (k - r - 1)))
        plan.run([(down, FWD), (up, FWD)] * (r + 1))
        for _ in range(k - r - 1):
            plan.add(up, INPUT)
            plan.weight()
            plan.add(up, FWD)
        plan.run([(down, FWD), (up, FULL), (up, FWD), (down, FULL)] * (m - 2 * k + r + 1))
        plan.run([(up, FULL), (up, FWD), (down, FULL)] * (k - r - 1))
        # from the middle round on (the up stage's turn first on odd ranks) the backward
        # is split, and the weight gradients fill the tail
        split = False
        for step in range(r + 1):
            split = split or (step == (r + 1) // 2 and r % 2 == 1)
            plan.add(up, INPUT if split else FULL)
            split = split or (step == (r + 1) // 2 and r % 2 == 0)
            plan.add(down, INPUT if split else FULL)
        for _ in range(k - r - 1):
            plan.weight()
            plan.add(down, INPUT if split else FULL)
        while plan.owed:
            plan.weight()
        actions.append(plan.actions)
    return Schedule(
        name="dualpipe-v",
        num_microbatches=num_microbatches,
        stage_to_rank=v_placement(k),
        actions=tuple(actions),
    )
