"""ZB-H2 (Qi et al., zero bubble): the larger memory budget that removes the bubble."""

from __future__ import annotations

from collections import deque

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["zb_h2"]


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2, the zero-bubble paper's zero-bubble schedule (Qi et al., 2024).

    The backward is split into ``I`` and ``W`` as in ZB-H1, and every stage may hold up
    to ``2K-1`` micro-batches (``F`` run, ``W`` not yet; the paper's ``(2p-1) M_B``,
    twice ZB-H1's budget). The order is what each stage does, tick by tick at unit cost,
    when it always runs the first of: its next ``I`` once that micro-batch's output
    gradient is there (the critical path), its next ``F`` once the input is there and
    fewer than ``2K-1`` micro-batches are in flight, its oldest owed ``W``. Stage ``j``
    thus warms up with ``2(K-j)-1`` forwards (rank 0 until the first gradient comes
    back), runs ``I`` s as fast as they come, and keeps the ``W`` s for the gaps, most
    of them for the tail.

    With ``F = I = W`` and ``M >= 2K-1`` the result is the paper's parallelogram: stage
    ``j`` is busy without a gap from tick ``j`` (its first input) to ``3M+j``, so a rank
    never idles between its first and last action (ZB-H1: ``K-1-j`` idle ticks inside),
    and where no optimizer step synchronizes the ranks (the paper's post-update
    validation) step ``t+1`` starts on rank 0 at ``3M``: zero bubble. One step alone
    still has the first input's ``K-1`` ticks to reach the last stage, ``(K-1) /
    (3M+K-1)`` of the time, as ZB-H1.

    Example (one column per clock tick, unit costs):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(zb_h2(3, 6)))
        rank 0: F0 F1 F2 F3 F4 I0 W0 I1 F5 I2 W1 I3 W2 I4 W3 W4 I5 W5
        rank 1: .  F0 F1 F2 I0 F3 I1 F4 I2 W0 I3 F5 I4 W1 W2 I5 W3 W4 W5
        rank 2: .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 W0 F5 I5 W1 W2 W3 W4 W5

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
        context="zb-h2",
    )
    k, m = num_stages, num_microbatches
    budget = 2 * k - 1
    # per stage: micro-batches whose F / I ran, W run, the W's owed, and the tick at
    # which each F / I ended (the next stage may use it from that tick on)
    forwards, inputs, weights = [0] * k, [0] * k, [0] * k
    owed: list[deque[int]] = [deque() for _ in range(k)]
    forward_end: list[list[int]] = [[] for _ in range(k)]
    input_end: list[list[int]] = [[] for _ in range(k)]
    actions: list[list[Action]] = [[] for _ in range(k)]
    tick = 0
    while any(w < m for w in weights):
        assert tick <= 4 * k * m + 2 * k, "zb-h2: the greedy order stopped making progress"
        chosen = []
        for j in range(k):
            i = inputs[j]
            if i < forwards[j] and (j == k - 1 or (i < len(input_end[j + 1]) and input_end[j + 1][i] <= tick)):
                chosen.append(Action(j, Op.BACKWARD_INPUT, i))
                continue
            i = forwards[j]
            arrived = j == 0 or (i < len(forward_end[j - 1]) and forward_end[j - 1][i] <= tick)
            if i < m and forwards[j] - weights[j] < budget and arrived:
                chosen.append(Action(j, Op.FORWARD, i))
            elif owed[j]:
                chosen.append(Action(j, Op.BACKWARD_WEIGHT, owed[j][0]))
        for a in chosen:  # every stage decided on the same tick's state: now apply
            j = a.stage
            actions[j].append(a)
            if a.op is Op.FORWARD:
                forwards[j] += 1
                forward_end[j].append(tick + 1)
            elif a.op is Op.BACKWARD_INPUT:
                inputs[j] += 1
                input_end[j].append(tick + 1)
                owed[j].append(a.microbatch)  # type: ignore[arg-type]
            else:
                weights[j] += 1
                owed[j].popleft()
        tick += 1
    return Schedule(
        name="zb-h2",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(num_stages)),
        actions=tuple(tuple(acts) for acts in actions),
    )
