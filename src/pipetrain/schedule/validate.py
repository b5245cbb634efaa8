"""The validator: every dependency satisfied, every message matched, no deadlock."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pipetrain.counts import count_of
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.execution import Blocked, execute
from pipetrain.schedule.grid import render_grid
from pipetrain.schedule.program import Schedule
from pipetrain.schedule.versions import is_versioned, version_problems

__all__ = ["ScheduleError", "deadlock_problems", "find_problems", "validate"]

_ZERO_COSTS = Costs(forward=0.0, backward=0.0)
_BACKWARD = (Op.BACKWARD, Op.BACKWARD_INPUT)
_COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
# op -> (matching op, stage offset of the matching action)
_PEER = {
    Op.SEND_FORWARD: (Op.RECV_FORWARD, 1),
    Op.RECV_FORWARD: (Op.SEND_FORWARD, -1),
    Op.SEND_BACKWARD: (Op.RECV_BACKWARD, -1),
    Op.RECV_BACKWARD: (Op.SEND_BACKWARD, 1),
}
_Key = tuple[Op, int, "int | None"]


class ScheduleError(ValueError):
    """A schedule that cannot run as written; ``problems`` lists every problem found.

    The message lists the problems, each naming the rank, the position in its action
    list and the action, followed by the text grid of what the schedule runs (up to a
    deadlock, if it has one).

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> s = Schedule(name="toy", num_microbatches=1, stage_to_rank=(0,),
        ...              actions=(tuple(parse_actions("0F0")),))
        >>> ScheduleError(s, ["0B0 is missing (rank 0)"]).problems
        ('0B0 is missing (rank 0)',)
    """

    def __init__(self, schedule: Schedule, problems: Sequence[str]) -> None:
        self.schedule = schedule
        self.problems = tuple(problems)
        super().__init__(
            f"schedule {schedule.name!r} ({count_of(schedule.num_ranks, 'rank')}, "
            f"{count_of(schedule.num_stages, 'stage')}, "
            f"{count_of(schedule.num_microbatches, 'micro-batch')}) has "
            f"{count_of(len(self.problems), 'problem')}:\n"
            + "\n".join(f"  - {p}" for p in self.problems)
            + "\nwhat it runs (one column per action at unit cost, '.' idle):\n"
            + render_grid(schedule)
        )


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` can run; see :func:`find_problems` for what is checked.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> bad = Schedule(name="bad", num_microbatches=1, stage_to_rank=(0,),
        ...                actions=(tuple(parse_actions("0B0 0F0")),))
        >>> validate(bad)
        Traceback (most recent call last):
        ...
        pipetrain.schedule.validate.ScheduleError: schedule 'bad' (1 rank, 1 stage, 1 micro-batch) has 1 problem:
          - rank 0, position 0: 0B0 runs before 0F0
        what it runs (one column per action at unit cost, '.' idle):
        rank 0: B0 F0

    Raises:
        ScheduleError: listing every problem at once.
    """
    problems = find_problems(schedule)
    if problems:
        raise ScheduleError(schedule, problems)


def find_problems(schedule: Schedule) -> list[str]:
    """Everything wrong with ``schedule``, each naming the rank, position and action.

    Checked: each action's stage lives on its rank and its micro-batch exists; each
    (stage, micro-batch) has one ``F`` and, in a training schedule, one ``B`` or one
    ``I`` and one ``W``; ``F`` after its input (the previous stage's ``F`` on the same
    rank, else an ``RF``), ``B``/``I`` after the ``F`` and after the output gradient (the
    next stage's ``B``/``I`` on the same rank, else an ``RB``), ``W`` after ``I``, each
    send after what it sends; every send matched by exactly one receive and the reverse,
    none between stages of one rank; ``REDUCE`` and ``STEP`` after the stage's last
    backward, ``REDUCE`` before ``STEP``; FSDP's ``UNSHARD`` / ``RESHARD`` paired around
    the stage's work (:func:`_shard_problems`); and no deadlock when sends never block and
    receives wait for their send. Without communication actions, cross-rank data flow
    is implicit (a forward waits for the previous stage's forward on its rank, ...).

    Example:
        >>> from pipetrain.schedule.gpipe import gpipe
        >>> find_problems(gpipe(4, 8))
        []
    """
    problems = _structure_problems(schedule)
    execution = execute(schedule, _ZERO_COSTS.per_stage(schedule.num_stages), record=False)
    return problems + deadlock_problems(schedule, execution.blocked)


def deadlock_problems(schedule: Schedule, blocked: Sequence[Blocked]) -> list[str]:
    """One line per stuck rank: where it is stuck and what it waits for.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> s = Schedule(name="toy", num_microbatches=1, stage_to_rank=(0, 1),
        ...              actions=(tuple(parse_actions("0RB0 0F0 0SF0 0B0")),
        ...                       tuple(parse_actions("1RF0 1F0 1B0 1SB0"))))
        >>> for line in deadlock_problems(s, execute(s, _ZERO_COSTS.per_stage(2)).blocked):
        ...     print(line)
        deadlock: rank 0, position 0: 0RB0 waits for 1SB0, which rank 1 runs only at position 3
        deadlock: rank 1, position 0: 1RF0 waits for 0SF0, which rank 0 runs only at position 2
    """
    positions = {
        (a.op, a.stage, a.microbatch): (r, p)
        for r, acts in enumerate(schedule.actions)
        for p, a in enumerate(acts)
    }
    stuck_at = {b.rank: b.position for b in blocked}
    lines = []
    for b in blocked:
        where = positions.get((b.awaited.op, b.awaited.stage, b.awaited.microbatch))
        if where is None:
            why = "which no rank runs"
        elif where[0] in stuck_at and stuck_at[where[0]] <= where[1]:
            why = f"which rank {where[0]} runs only at position {where[1]}"
        else:
            why = f"which rank {where[0]} runs at position {where[1]}"
        lines.append(
            f"deadlock: rank {b.rank}, position {b.position}: {b.action} waits for "
            f"{b.awaited}, {why}"
        )
    return lines


def _structure_problems(schedule: Schedule) -> list[str]:
    explicit = any(a.op.is_communication for acts in schedule.actions for a in acts)
    # (op, stage, micro-batch) -> [(rank, position), ...] of the well-formed actions
    where: dict[_Key, list[tuple[int, int]]] = defaultdict(list)
    problems: list[str] = []
    for r, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            problem = _shape_problem(a, r, schedule)
            if problem:
                problems.append(f"rank {r}, position {p}: {a} {problem}")
            else:
                where[(a.op, a.stage, a.microbatch)].append((r, p))

    for (op, j, i), places in where.items():
        for r, p in places:
            for alternatives in _dependencies(op, j, i, r, schedule, explicit=explicit):
                # a dependency of a well-formed action lives on the same rank, so its
                # first place is its earliest
                found = [where[key][0][1] for key in alternatives if key in where]
                if found and min(found) < p:
                    continue
                dependency = Action(alternatives[0][1], alternatives[0][0], alternatives[0][2])
                if found:
                    reason = f"runs before {dependency}"
                elif dependency.op.is_communication:
                    reason = f"has no {dependency} before it"
                else:
                    continue  # an absent compute action is reported once, below
                problems.append(f"rank {r}, position {p}: {schedule.actions[r][p]} {reason}")
    problems += _count_problems(schedule, where)
    problems += _message_problems(where)
    if is_versioned(schedule):  # asynchronous: a STEP per update, checked with the versions
        problems += version_problems(schedule)
    else:
        problems += _step_problems(schedule, where)
    problems += _shard_problems(schedule)
    return problems


def _dependencies(
    op: Op, j: int, i: int | None, r: int, schedule: Schedule, *, explicit: bool
) -> list[tuple[_Key, ...]]:
    """What must run before ``op`` (stage ``j``, micro-batch ``i``) on rank ``r``: one of
    each tuple of alternatives. Cross-rank inputs count only as explicit receives."""
    num_stages = schedule.num_stages
    if op is Op.FORWARD:
        if j > 0 and schedule.rank_of(j - 1, i) == r:
            return [((Op.FORWARD, j - 1, i),)]
        return [((Op.RECV_FORWARD, j, i),)] if j > 0 and explicit else []
    if op in _BACKWARD:
        needs: list[tuple[_Key, ...]] = [((Op.FORWARD, j, i),)]
        if j + 1 < num_stages and schedule.rank_of(j + 1, i) == r:
            needs.append(tuple((b, j + 1, i) for b in _BACKWARD))
        elif j + 1 < num_stages and explicit:
            needs.append(((Op.RECV_BACKWARD, j, i),))
        return needs
    if op is Op.BACKWARD_WEIGHT:
        return [((Op.BACKWARD_INPUT, j, i),)]
    if op is Op.SEND_FORWARD:
        return [((Op.FORWARD, j, i),)]
    if op is Op.SEND_BACKWARD:
        return [tuple((b, j, i) for b in _BACKWARD)]
    return []


def _shape_problem(a: Action, r: int, schedule: Schedule) -> str:
    """Why ``a`` on rank ``r`` is malformed, or ``""``."""
    j, i = a.stage, a.microbatch
    num_stages, num_microbatches = schedule.num_stages, schedule.num_microbatches
    if not 0 <= j < num_stages:
        return f"names stage {j}, but the schedule has stages 0..{num_stages - 1}"
    if r not in schedule.ranks_of(j):
        return f"is for stage {j}, which lives on rank {schedule.rank_of(j)}, not rank {r}"
    if a.op.needs_microbatch and (i is None or not 0 <= i < num_microbatches):
        return f"needs a micro-batch in 0..{num_microbatches - 1}, got {i}"
    if not a.op.needs_microbatch and i is not None:
        return f"takes no micro-batch, got {i}"
    if i is not None and schedule.rank_of(j, i) != r:
        return (f"is for micro-batch {i} of stage {j}, which its replica on rank "
                f"{schedule.rank_of(j, i)} runs, not rank {r}")
    if a.op.is_communication:
        peer = j + _PEER[a.op][1]
        if not 0 <= peer < num_stages:
            return f"has no stage {peer} to talk to"
        if schedule.rank_of(peer, i) == r:
            return f"talks to stage {peer} on the same rank (the hand-off is local; remove it)"
    return ""


def _count_problems(schedule: Schedule, where: dict[_Key, list[tuple[int, int]]]) -> list[str]:
    """Each (stage, micro-batch): one F; in training, one B or one I and one W."""
    problems = []
    training = schedule.is_training

    def places(key: _Key) -> str:
        return ", ".join(f"rank {r} position {p}" for r, p in where.get(key, ()))

    for j in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            counts = {op: len(where.get((op, j, i), ())) for op in _COMPUTE_OPS}
            for op, n in counts.items():
                if n > 1:
                    problems.append(f"{Action(j, op, i)} runs {n} times ({places((op, j, i))})")
            if counts[Op.FORWARD] == 0:
                problems.append(
                    f"{Action(j, Op.FORWARD, i)} is missing (rank {schedule.rank_of(j, i)})"
                )
            if not training:
                continue
            b, inp, w = counts[Op.BACKWARD], counts[Op.BACKWARD_INPUT], counts[Op.BACKWARD_WEIGHT]
            if b and (inp or w):
                problems.append(
                    f"{Action(j, Op.BACKWARD, i)} ({places((Op.BACKWARD, j, i))}) and a split "
                    f"backward ({Action(j, Op.BACKWARD_INPUT, i)}/{Action(j, Op.BACKWARD_WEIGHT, i)}) "
                    f"both run; use one B, or one I and one W"
                )
            elif not b and not inp and not w:
                problems.append(
                    f"{Action(j, Op.BACKWARD, i)} is missing (rank {schedule.rank_of(j, i)}): no "
                    f"B, nor I and W"
                )
            elif inp and not w:
                problems.append(
                    f"{Action(j, Op.BACKWARD_WEIGHT, i)} is missing: "
                    f"{Action(j, Op.BACKWARD_INPUT, i)} ({places((Op.BACKWARD_INPUT, j, i))}) "
                    f"needs a W"
                )
            elif w and not inp:
                problems.append(
                    f"{Action(j, Op.BACKWARD_WEIGHT, i)} ({places((Op.BACKWARD_WEIGHT, j, i))}) "
                    f"has no {Action(j, Op.BACKWARD_INPUT, i)}"
                )
    return problems


def _message_problems(where: dict[_Key, list[tuple[int, int]]]) -> list[str]:
    """Every send matched by exactly one receive, and every receive by one send."""
    problems = []
    for (op, j, i), places in where.items():
        if not op.is_communication:
            continue
        peer_op, offset = _PEER[op]
        peer = Action(j + offset, peer_op, i)
        peers = where.get((peer_op, j + offset, i), [])
        if not peers:
            problems += [
                f"rank {r}, position {p}: {Action(j, op, i)} has no matching {peer}"
                for r, p in places
            ]
        elif len(places) > 1:
            r, p = places[1]
            problems.append(
                f"rank {r}, position {p}: {Action(j, op, i)} runs {len(places)} times but "
                f"each message is sent and received exactly once"
            )
    return problems


def _shard_problems(schedule: Schedule) -> list[str]:
    """FSDP's gathers, for each stage of a rank that has an ``UNSHARD``: its compute
    actions and ``REDUCE`` between an ``UNSHARD`` and the next ``RESHARD``, no ``UNSHARD``
    of gathered parameters nor ``RESHARD`` of sharded ones, ``STEP`` on the shards, the
    stage sharded again at the end; and as many gathers on every rank holding the stage
    (each is a collective of its replicas)."""
    problems = []
    gathers: dict[int, dict[int, int]] = defaultdict(dict)  # stage -> rank -> UNSHARDs
    for r, acts in enumerate(schedule.actions):
        fsdp = {a.stage for a in acts if a.op is Op.UNSHARD or a.op is Op.RESHARD}
        gathered: set[int] = set()
        for p, a in enumerate(acts):
            j = a.stage
            if j not in fsdp:
                continue
            where = f"rank {r}, position {p}: {a}"
            if a.op is Op.UNSHARD:
                gathers[j][r] = gathers[j].get(r, 0) + 1
                if j in gathered:
                    problems.append(f"{where} gathers parameters already gathered (no "
                                    f"{Action(j, Op.RESHARD)} since the last {a})")
                gathered.add(j)
            elif a.op is Op.RESHARD:
                if j not in gathered:
                    problems.append(f"{where} frees parameters that are not gathered")
                gathered.discard(j)
            elif a.op is Op.OPTIMIZER_STEP and j in gathered:
                problems.append(f"{where} updates stage {j} while its parameters are gathered; "
                                f"fix: {Action(j, Op.RESHARD)} before it")
            elif (a.op.is_compute or a.op is Op.REDUCE_GRAD) and j not in gathered:
                problems.append(f"{where} runs on sharded parameters; fix: "
                                f"{Action(j, Op.UNSHARD)} before it")
        problems += [f"rank {r}: stage {j}'s parameters are still gathered at the end; fix: "
                     f"{Action(j, Op.RESHARD)} after its last action" for j in sorted(gathered)]
    for j, counts in sorted(gathers.items()):
        holders = {r: counts.get(r, 0) for r in schedule.ranks_of(j)}
        if len(set(holders.values())) > 1:
            problems.append(f"stage {j}'s replicas gather its parameters a different number of "
                            f"times ({', '.join(f'rank {r}: {n}' for r, n in holders.items())}): "
                            "each gather is a collective of all of them")
    return problems


def _step_problems(schedule: Schedule, where: dict[_Key, list[tuple[int, int]]]) -> list[str]:
    """REDUCE and STEP once per stage on each rank holding it, after the stage's last
    backward on that rank; REDUCE before STEP."""
    problems = []
    last_backward: dict[tuple[int, int], tuple[int, Action]] = {}
    for (op, j, i), places in where.items():
        if op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            for r, p in places:
                if p > last_backward.get((j, r), (-1,))[0]:
                    last_backward[(j, r)] = (p, Action(j, op, i))
    for op in (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP):
        for j in range(schedule.num_stages):
            action = Action(j, op)
            for holder in schedule.ranks_of(j):
                places = [(r, p) for r, p in where.get((op, j, None), []) if r == holder]
                if len(places) > 1:
                    r, p = places[1]
                    problems.append(f"rank {r}, position {p}: {action} runs {len(places)} times")
                for r, p in places[:1]:
                    q, backward = last_backward.get((j, r), (-1, action))
                    if q > p:
                        problems.append(f"rank {r}, position {p}: {action} runs before {backward}")
                    reduce = [q for h, q in where.get((Op.REDUCE_GRAD, j, None), []) if h == r]
                    if op is Op.OPTIMIZER_STEP and reduce and reduce[0] > p:
                        problems.append(
                            f"rank {r}, position {p}: {action} runs before {Action(j, Op.REDUCE_GRAD)}"
                        )
    return problems
