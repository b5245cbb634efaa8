"""The execution model: ranks run their action lists in order, receives wait for sends.

Shared by the simulator (which times a schedule) and the validator (which finds out
whether it deadlocks). Each rank runs its list in order; a compute action takes its cost;
a send keeps the sender busy for its ``send`` cost (0 by default) and arrives
``communication`` after it ends; a receive waits until its message has arrived. A schedule without communication actions (as generators
return them) gets implicit messages: a forward whose previous stage lives on another rank
waits for that stage's forward (plus the latency), and likewise a backward for the next
stage's backward (``B`` or ``I``). ``REDUCE`` starts an all-reduce that runs in the
background for its cost; the stage's ``STEP`` waits for it, then takes its cost. FSDP's
``UNSHARD`` starts a gather of the stage's parameters in the background for its
``unshard`` cost, and the stage's next compute action on that rank waits for it;
``RESHARD`` takes no time (and frees once the stage's background ``REDUCE`` has ended).

Whether a rank can go on depends only on which actions have run, never on their cost, so
a schedule deadlocks under every costs or under none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.costs import StageCosts
from pipetrain.schedule.program import Schedule

__all__ = ["Blocked", "Execution", "TimedAction", "execute"]


class TimedAction(NamedTuple):
    """When one action ran on one rank: simulated, or measured by the runtime (seconds).

    For a receive, ``start`` is when the rank reached it and ``end`` when the message was
    there; a send lasts its ``send`` cost; a ``REDUCE`` spans its background all-reduce.

    Example:
        >>> from pipetrain.schedule.actions import parse_action
        >>> TimedAction(0, parse_action("0F1"), 1.0, 2.0).end
        2.0
    """

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Blocked:
    """A rank that cannot go on: the action it is at and the action that it waits for.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> from pipetrain.schedule.costs import Costs
        >>> s = Schedule(name="toy", num_microbatches=1, stage_to_rank=(0, 1),
        ...              actions=(tuple(parse_actions("0B0 0F0")), tuple(parse_actions("1F0 1B0"))))
        >>> [(b.rank, b.position, str(b.action), str(b.awaited)) for b in
        ...  execute(s, Costs().per_stage(2)).blocked]
        [(0, 0, '0B0', '1B0'), (1, 0, '1F0', '0F0')]
    """

    rank: int
    position: int
    action: Action
    awaited: Action
    awaited_rank: int


@dataclass(frozen=True)
class Execution:
    """What ran, when; ``blocked`` is empty unless the schedule deadlocks (see
    :func:`execute`)."""

    timeline: tuple[TimedAction, ...]
    blocked: tuple[Blocked, ...]


# kinds of compiled steps
_COMPUTE, _SEND, _RECV, _REDUCE, _STEP, _UNSHARD, _RESHARD = range(7)
# a message key: (op that produces it, stage, micro-batch)
_Key = tuple[Op, int, int]
# kind, action, duration, awaited key, published key, publish latency
_Step = tuple[int, Action, float, "_Key | None", "_Key | None", float]
_BACKWARD_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT)
_RECEIVED_FROM = {Op.RECV_FORWARD: (Op.SEND_FORWARD, -1), Op.RECV_BACKWARD: (Op.SEND_BACKWARD, 1)}


def execute(schedule: Schedule, costs: StageCosts, *, record: bool = True) -> Execution:
    """Run ``schedule`` under ``costs``; with ``record=False`` the timeline stays empty.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> from pipetrain.schedule.costs import Costs
        >>> s = Schedule(name="toy", num_microbatches=1, stage_to_rank=(0, 1),
        ...              actions=(tuple(parse_actions("0F0 0B0")), tuple(parse_actions("1F0 1B0"))))
        >>> [(str(t.action), t.start, t.end) for t in execute(s, Costs().per_stage(2)).timeline]
        [('0F0', 0.0, 1.0), ('0B0', 4.0, 6.0), ('1F0', 1.0, 2.0), ('1B0', 2.0, 4.0)]
    """
    implicit = not any(a.op.is_communication for acts in schedule.actions for a in acts)
    programs = [
        [_compile(schedule, r, a, costs, implicit=implicit) for a in acts]
        for r, acts in enumerate(schedule.actions)
    ]
    num_ranks = len(programs)
    arrival: dict[_Key, float] = {}
    waiting: dict[_Key, list[int]] = {}
    reduce_end: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its REDUCE ends
    gathered: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its UNSHARD ends
    position = [0] * num_ranks
    clock = [0.0] * num_ranks
    timelines: list[list[TimedAction]] = [[] for _ in range(num_ranks)]
    runnable = list(range(num_ranks))
    while runnable:
        r = runnable.pop()
        program, p, t, out = programs[r], position[r], clock[r], timelines[r]
        while p < len(program):
            kind, action, duration, awaited, published, latency = program[p]
            start = t
            if awaited is not None:
                ready = arrival.get(awaited)
                if ready is None:
                    waiting.setdefault(awaited, []).append(r)
                    break
                if ready > t:
                    if kind == _RECV:
                        t = ready
                    else:
                        start = ready
            if kind == _RECV:
                end = t
            elif kind == _SEND:
                end = t = t + duration
            elif kind == _REDUCE:
                end = start + duration
                reduce_end[(r, action.stage)] = end
            elif kind == _UNSHARD:
                end = gathered[(r, action.stage)] = start + duration
            elif kind == _RESHARD:  # frees once the reduce-scatter has read the gradients
                start = end = max(start, reduce_end.get((r, action.stage), start))
            else:
                if kind == _STEP:
                    start = max(start, reduce_end.get((r, action.stage), start))
                elif gathered:
                    start = max(start, gathered.get((r, action.stage), start))
                end = t = start + duration
            if record:
                out.append(TimedAction(r, action, start, end))
            if published is not None and published not in arrival:
                arrival[published] = end + latency
                runnable.extend(waiting.pop(published, ()))
            p += 1
        position[r], clock[r] = p, t
    blocked = tuple(
        _blocked(schedule, r, position[r], programs[r][position[r]][3])
        for r in range(num_ranks)
        if position[r] < len(programs[r])
    )
    return Execution(tuple(t for out in timelines for t in out), blocked)


def _compile(
    schedule: Schedule, rank: int, action: Action, costs: StageCosts, *, implicit: bool
) -> _Step:
    """One action as a step: its kind, cost, the message it awaits and the one it posts."""
    op, j, i = action.op, action.stage, action.microbatch
    num_stages = len(schedule.stage_to_rank)
    rank_of = schedule.rank_of
    if not 0 <= j < num_stages:  # reported by the validator; run it as a no-op
        return (_SEND, action, 0.0, None, None, 0.0)
    if op is Op.REDUCE_GRAD:
        return (_REDUCE, action, costs.reduce[j], None, None, 0.0)
    if op is Op.OPTIMIZER_STEP:
        return (_STEP, action, costs.step[j], None, None, 0.0)
    if op is Op.UNSHARD:
        return (_UNSHARD, action, costs.unshard[j], None, None, 0.0)
    if op is Op.RESHARD:
        return (_RESHARD, action, 0.0, None, None, 0.0)
    if i is None:  # reported by the validator
        return (_SEND, action, 0.0, None, None, 0.0)
    latency = costs.communication[j]
    if op in _RECEIVED_FROM:
        send_op, offset = _RECEIVED_FROM[op]
        return (_RECV, action, 0.0, (send_op, j + offset, i), None, 0.0)
    if op is Op.SEND_FORWARD or op is Op.SEND_BACKWARD:
        return (_SEND, action, costs.send[j], None, (op, j, i), latency)
    duration = {
        Op.FORWARD: costs.forward,
        Op.BACKWARD: costs.backward,
        Op.BACKWARD_INPUT: costs.backward_input,
        Op.BACKWARD_WEIGHT: costs.backward_weight,
    }[op][j]
    awaited = published = None
    if implicit and op is Op.FORWARD:
        if j > 0 and rank_of(j - 1, i) != rank:
            awaited = (Op.FORWARD, j - 1, i)
        if j + 1 < num_stages and rank_of(j + 1, i) != rank:
            published = (Op.FORWARD, j, i)
    elif implicit and op in _BACKWARD_OPS:
        if j + 1 < num_stages and rank_of(j + 1, i) != rank:
            awaited = (Op.BACKWARD, j + 1, i)
        if j > 0 and rank_of(j - 1, i) != rank:
            published = (Op.BACKWARD, j, i)
    return (_COMPUTE, action, duration, awaited, published, latency)


def _blocked(schedule: Schedule, rank: int, position: int, awaited: _Key | None) -> Blocked:
    assert awaited is not None, "only a step that awaits a message can block"
    op, j, i = awaited
    if op is Op.BACKWARD:  # an implicit gradient comes from a B or an I
        has_input_backward = any(
            a.op is Op.BACKWARD_INPUT and a.stage == j and a.microbatch == i
            for acts in schedule.actions
            for a in acts
        )
        op = Op.BACKWARD_INPUT if has_input_backward else Op.BACKWARD
    return Blocked(
        rank=rank,
        position=position,
        action=schedule.actions[rank][position],
        awaited=Action(j, op, i),
        awaited_rank=schedule.rank_of(j, i) if 0 <= j < schedule.num_stages else -1,
    )
