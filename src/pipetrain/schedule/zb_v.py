"""ZB-V (Qi et al.): zero bubble at 1F1B's memory, two stages per rank folded into a V."""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Op
from pipetrain.schedule.program import Schedule, v_placement
from pipetrain.schedule.rank_plan import RankPlan

__all__ = ["zb_v"]

FWD, INPUT, WEIGHT = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V, the V-shaped zero-bubble schedule (Qi et al., 2024, "Pipeline parallelism
    with controllable memory"; the zero-bubble paper's section 6).

    The model is cut into ``2K`` stages; rank ``r`` holds stage ``r`` (the V's way
    down) and stage ``2K-1-r`` (its way back up), so the first and the last stage share
    rank 0 and each micro-batch goes down the ranks and back. The backward is split
    into ``I`` and ``W``. Rank ``r`` runs, with ``d = r`` and ``u = 2K-1-r``:

    1. warm-up: ``2(K-r)-1`` forwards of ``d``, then ``r`` times ``F(u) F(d)``, then
       ``K-r`` times ``F(u) I(u) W(u)``;
    2. steady state, until every forward has run: ``F(d) I(d) W(d) F(u) I(u) W(u)``;
    3. cool-down: ``r`` times ``I(d) I(u)``, ``K-r`` times ``I(d) W(d)``, then the
       ``W`` s still owed.

    With ``F = I = W`` (per stage) every rank is busy but for the ``K-1`` ticks before
    the first micro-batch reaches the V's bottom (rank ``K-1``), which no schedule can
    avoid: the bubble is ``(K-1) / (6M+K-1)`` of the time (the paper: zero, as ``M``
    grows). Every rank holds at most ``2K`` stage-micro-batches (``F`` run, ``W`` not
    yet), each half a 1F1B stage: 1F1B's peak memory (``K`` full stages), on every
    rank. The shape needs ``M >= 2K-1``; with fewer micro-batches the schedule is the
    one for ``2K-1`` with the missing micro-batches left out.

    Example (one column per clock tick, unit costs; cells name the stage):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(zb_v(2, 3)))
        rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2
        rank 1: .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2

    Raises:
        ValueError: ``num_ranks`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_ranks": (num_ranks, 1), "num_microbatches": (num_microbatches, 1)},
        context="zb-v",
    )
    k, m = num_ranks, max(num_microbatches, 2 * num_ranks - 1)
    actions = []
    for r in range(k):
        down, up = r, 2 * k - 1 - r
        plan = RankPlan(num_microbatches)
        plan.run([(down, FWD)] * (2 * (k - r) - 1))
        plan.run([(up, FWD), (down, FWD)] * r)
        plan.run([(up, FWD), (up, INPUT), (up, WEIGHT)] * (k - r))
        for step in range(m - k):
            if step < m - 2 * k + 1 + r:  # forwards of the way down left
                plan.add(down, FWD)
            plan.run([(down, INPUT), (down, WEIGHT), (up, FWD), (up, INPUT), (up, WEIGHT)])
        plan.run([(down, INPUT), (up, INPUT)] * r)
        plan.run([(down, INPUT), (down, WEIGHT)] * (k - r))
        plan.run([(up, WEIGHT)] * r + [(down, WEIGHT)] * r)
        actions.append(plan.actions)
    return Schedule(
        name="zb-v",
        num_microbatches=num_microbatches,
        stage_to_rank=v_placement(k),
        actions=tuple(actions),
    )
