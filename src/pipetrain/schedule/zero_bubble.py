"""ZB-H1 (Qi et al., zero bubble): backward split in I and W, the Ws fill the bubbles."""

from __future__ import annotations

from collections import deque

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["zb_h1"]


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1, the zero-bubble paper's memory-efficient schedule (Qi et al., 2024).

    The backward is split into ``I`` (gradients of the stage's inputs, on the critical
    path) and ``W`` (gradients of its weights, any time after ``I``). Stage ``j`` warms
    up like 1F1B (``min(K-j-1, M)`` forwards), then runs ``F I`` pairs, starting its
    ``W`` s ``j`` micro-batches late; in the cool-down one deferred ``W`` follows each
    ``I``, and the last ``j`` fill the tail. With ``F = I = W`` the bubble time is a third
    of 1F1B's: ``(K-1)*F`` per rank instead of ``(K-1)*(F+B)``.

    Memory, as in the paper: stage ``j`` keeps at most ``min(K-j, M)`` micro-batches'
    full activations (``F`` run, ``I`` not yet, as 1F1B) plus up to ``j`` waiting for
    their ``W`` (which need only the layer inputs and output gradients), so every stage
    has ``min(K, M)`` in flight (``F`` to ``W``): 1F1B's peak, the one of its first stage.

    Example (one column per clock tick, unit costs):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(zb_h1(3, 4)))
        rank 0: F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
        rank 1: .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        rank 2: .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    check_counts(
        {"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
        context="zb-h1",
    )
    actions = []
    for j in range(num_stages):
        num_warmup = min(num_stages - j - 1, num_microbatches)
        stage_actions = [Action(j, Op.FORWARD, i) for i in range(num_warmup)]
        waiting: deque[int] = deque()  # micro-batches whose I ran and whose W has not
        for k in range(num_microbatches - num_warmup):
            stage_actions += [
                Action(j, Op.FORWARD, num_warmup + k),
                Action(j, Op.BACKWARD_INPUT, k),
            ]
            waiting.append(k)
            if k >= j:
                stage_actions.append(Action(j, Op.BACKWARD_WEIGHT, waiting.popleft()))
        for i in range(num_microbatches - num_warmup, num_microbatches):
            waiting.append(i)
            stage_actions += [
                Action(j, Op.BACKWARD_INPUT, i),
                Action(j, Op.BACKWARD_WEIGHT, waiting.popleft()),
            ]
        stage_actions += [Action(j, Op.BACKWARD_WEIGHT, i) for i in waiting]
        actions.append(tuple(stage_actions))
    return Schedule(
        name="zb-h1",
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(num_stages)),
        actions=tuple(actions),
    )
