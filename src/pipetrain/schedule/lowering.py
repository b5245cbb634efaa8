"""Lowering: from compute-only schedules to what ranks run (messages, all-reduce, step,
FSDP's gathers)."""

from __future__ import annotations

from collections.abc import Callable

from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["add_communication", "add_fsdp_actions", "add_optimizer_step", "complete_lowering"]

_BACKWARD = (Op.BACKWARD, Op.BACKWARD_INPUT)
_LAST_BACKWARD = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


def add_communication(schedule: Schedule) -> Schedule:
    """Add the sends and receives between stages on different ranks.

    ``RF`` right before each ``F`` whose previous stage is on another rank, ``SF`` right
    after each ``F`` whose next stage is; ``RB`` right before each ``B``/``I`` whose next
    stage is on another rank, ``SB`` right after each ``B``/``I`` whose previous stage
    is. Stages on the same rank hand over locally. A schedule that was deadlock-free
    with implicit messages stays so (sends never block; each receive waits for what
    the compute action waited for).

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> print(add_communication(gpipe(2, 1)))
        rank 0: 0F0 0SF0 0RB0 0B0
        rank 1: 1RF0 1F0 1B0 1SB0

    Raises:
        ValueError: the schedule already has communication actions.
    """
    _check_no(schedule, lambda a: a.op.is_communication, what="communication actions")
    rank_of, num_stages = schedule.rank_of, schedule.num_stages
    lowered = []
    for r, actions in enumerate(schedule.actions):
        rank_actions = []
        for a in actions:
            j, i, v = a.stage, a.microbatch, a.version
            previous_remote = 0 < j < num_stages and rank_of(j - 1, i) != r
            next_remote = 0 <= j < num_stages - 1 and rank_of(j + 1, i) != r
            if a.op is Op.FORWARD:
                if previous_remote:
                    rank_actions.append(Action(j, Op.RECV_FORWARD, i, v))
                rank_actions.append(a)
                if next_remote:
                    rank_actions.append(Action(j, Op.SEND_FORWARD, i, v))
            elif a.op in _BACKWARD:
                if next_remote:
                    rank_actions.append(Action(j, Op.RECV_BACKWARD, i, v))
                rank_actions.append(a)
                if previous_remote:
                    rank_actions.append(Action(j, Op.SEND_BACKWARD, i, v))
            else:
                rank_actions.append(a)
        lowered.append(rank_actions)
    return schedule.replace_actions(lowered)


def add_optimizer_step(schedule: Schedule, *, reduce: bool) -> Schedule:
    """Add each stage's optimizer ``STEP`` (and, if ``reduce``, its gradient ``REDUCE``).

    With ``reduce``, ``REDUCE`` for stage ``j`` goes right after stage ``j``'s last
    backward action (``B`` or ``W``; after that action's own ``SB``, if it has one, so
    the gradient leaves first), and the all-reduce overlaps the rank's later work. Then
    each rank's list ends with a ``STEP`` for each of its stages, in increasing order.

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> print(add_optimizer_step(gpipe(2, 2), reduce=True))
        rank 0: 0F0 0F1 0B0 0B1 0REDUCE 0STEP
        rank 1: 1F0 1F1 1B0 1B1 1REDUCE 1STEP

    Raises:
        ValueError: the schedule is forward-only, or already has ``REDUCE``/``STEP``.
    """
    if not schedule.is_training:
        raise ValueError(
            f"schedule {schedule.name!r} is forward-only: it has no gradients to reduce or "
            f"step; add the optimizer step to a training schedule"
        )
    _check_no(
        schedule,
        lambda a: a.op in (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP),
        what="REDUCE or STEP actions",
    )
    lowered = []
    for r, actions in enumerate(schedule.actions):
        rank_actions = list(actions)
        if reduce:
            last = {a.stage: p for p, a in enumerate(actions) if a.op in _LAST_BACKWARD}
            for j, p in sorted(last.items(), key=lambda item: -item[1]):
                after = p + 1
                sent = Action(j, Op.SEND_BACKWARD, actions[p].microbatch, actions[p].version)
                if actions[p].op is Op.BACKWARD and actions[p + 1 : p + 2] == (sent,):
                    after += 1
                rank_actions.insert(after, Action(j, Op.REDUCE_GRAD))
        rank_actions += [Action(j, Op.OPTIMIZER_STEP) for j in schedule.stages_of(r)]
        lowered.append(rank_actions)
    return schedule.replace_actions(lowered)


def add_fsdp_actions(schedule: Schedule) -> Schedule:
    """Add FSDP's parameter gathers: each stage's ``UNSHARD`` one compute action before
    the stage's first action on its rank (the all-gather overlaps that action; at the
    start of the list if none precedes it), and its ``RESHARD`` after its ``REDUCE`` (in a
    forward-only schedule, after its last action). The parameters stay gathered across
    the step's micro-batches: one all-gather and one reduce-scatter per stage and step.

    Example:
        >>> from pipetrain.schedule.registry import build_schedule
        >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=2, optimizer_step=True,
        ...                    reduce=True)
        >>> print(add_fsdp_actions(s))
        rank 0: 0UNSHARD 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0REDUCE 0RESHARD 0STEP
        rank 1: 1UNSHARD 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1REDUCE 1RESHARD 1STEP

    Raises:
        ValueError: the schedule already has ``UNSHARD`` or ``RESHARD`` actions, or it is
            a training schedule without a ``REDUCE`` for each of its stages.
    """
    _check_no(schedule, lambda a: a.op in (Op.UNSHARD, Op.RESHARD),
              what="UNSHARD or RESHARD actions")
    training = schedule.is_training
    lowered = []
    for r, actions in enumerate(schedule.actions):
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for p, a in enumerate(actions):
            if a.op.needs_microbatch or a.op is Op.REDUCE_GRAD:
                first.setdefault(a.stage, p)
                if not training or a.op is Op.REDUCE_GRAD:
                    last[a.stage] = p
        missing = sorted(set(first) - set(last))
        if missing:
            raise ValueError(f"schedule {schedule.name!r}: rank {r} has no REDUCE for stage(s) "
                             f"{missing}, after which FSDP frees the gathered parameters; fix: "
                             "lower it with add_optimizer_step(schedule, reduce=True) first")
        before: dict[int, list[int]] = {}
        for j, p in first.items():
            earlier = [q for q in range(p) if actions[q].op.is_compute]
            before.setdefault(earlier[-1] if earlier else 0, []).append(j)
        after = {p: j for j, p in last.items()}
        rank_actions: list[Action] = []
        for p, a in enumerate(actions):
            rank_actions += [Action(j, Op.UNSHARD) for j in before.get(p, ())]
            rank_actions.append(a)
            if p in after:
                rank_actions.append(Action(after[p], Op.RESHARD))
        lowered.append(rank_actions)
    return schedule.replace_actions(lowered)


def complete_lowering(schedule: Schedule) -> Schedule:
    """Lower what a schedule leaves out, as the runtime needs it: the sends and receives
    when it has none, and in a training schedule each stage's ``REDUCE`` and ``STEP``
    when it has no ``STEP``. A schedule that has them is taken as written (and must
    then give every stage its ``STEP`` on every rank holding it).

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> print(complete_lowering(gpipe(2, 1)))
        rank 0: 0F0 0SF0 0RB0 0B0 0REDUCE 0STEP
        rank 1: 1RF0 1F0 1B0 1SB0 1REDUCE 1STEP
        >>> complete_lowering(complete_lowering(gpipe(2, 1))) == complete_lowering(gpipe(2, 1))
        True

    Raises:
        ValueError: the schedule has ``REDUCE`` actions but no ``STEP``, or ``STEP`` s
            for some of its stages only.
    """
    if not any(a.op.is_communication for acts in schedule.actions for a in acts):
        schedule = add_communication(schedule)
    if not schedule.is_training:
        return schedule
    steps = {(r, a.stage) for r, acts in enumerate(schedule.actions) for a in acts
             if a.op is Op.OPTIMIZER_STEP}
    if not steps:
        if any(a.op is Op.REDUCE_GRAD for acts in schedule.actions for a in acts):
            raise ValueError(
                f"schedule {schedule.name!r} has REDUCE actions but no STEP: its gradients "
                "would never be applied; fix: end each rank with a STEP for each of its "
                "stages (e.g. '0STEP'), or leave out both and let the library add them"
            )
        return add_optimizer_step(schedule, reduce=True)
    missing = [f"{Action(j, Op.OPTIMIZER_STEP)} on rank {r}"
               for j in range(schedule.num_stages) for r in schedule.ranks_of(j)
               if (r, j) not in steps]
    if missing:
        raise ValueError(
            f"schedule {schedule.name!r} steps some stages but not {', '.join(missing)}; "
            "fix: a STEP for every stage on each rank holding it, or no STEP at all (the "
            "library then adds them)"
        )
    return schedule


def _check_no(schedule: Schedule, unwanted: Callable[[Action], bool], *, what: str) -> None:
    found = [
        f"rank {r}, position {p}: {a}"
        for r, acts in enumerate(schedule.actions)
        for p, a in enumerate(acts)
        if unwanted(a)
    ]
    if found:
        raise ValueError(f"schedule {schedule.name!r} already has {what} ({found[0]}, ...)")
