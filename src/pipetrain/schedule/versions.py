"""Weight versions in a schedule: their rules, checked, and the versions a stage keeps.

Asynchronous schedules (:mod:`.async_stream`) tag actions with weight versions. On each
rank and stage, version ``v`` is the weights after ``v`` optimizer steps: ``STEP`` with
version ``v`` produces it, a forward may use any version produced so far, and the backward
of a micro-batch uses the version of its forward (weight stashing).

A stage keeps its live weights (the newest version), plus each older version that a
micro-batch in flight (forward run, backward not yet) uses or that a later forward will
use. :func:`versions_held` counts them from the action lists alone: the memory the
papers state (PipeDream: the micro-batches in flight on the stage; PipeDream-2BW: two),
which the runtime's :mod:`pipetrain.runtime.weight_versions` measures.
"""

from __future__ import annotations

from collections import Counter

from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule

__all__ = ["is_versioned", "version_problems", "versions_held"]

_VERSIONED = (Op.FORWARD, Op.BACKWARD)


def is_versioned(schedule: Schedule) -> bool:
    """Whether any action carries a weight version.

    Example:
        >>> from pipetrain.schedule.one_f_one_b import one_f_one_b
        >>> is_versioned(one_f_one_b(2, 2))
        False
    """
    return any(a.version is not None for acts in schedule.actions for a in acts)


def version_problems(schedule: Schedule) -> list[str]:
    """Everything wrong with the versions of a versioned schedule (see the module doc).

    Checked per rank and stage: every ``F``, ``B`` and ``STEP`` has a version, and no
    other action has one except messages (which carry their compute's); ``STEP`` s
    produce versions ``1, 2, 3, ...`` in order, a replicated stage's each after a
    ``REDUCE``, and every replica of a stage runs as many; a forward uses a version
    already produced; a backward uses its forward's version.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> s = Schedule(name="toy", num_microbatches=2, stage_to_rank=(0,),
        ...              actions=(tuple(parse_actions("0F0v0 0B0v0 0STEPv1 0F1v2 0B1v1 0STEPv2")),))
        >>> for line in version_problems(s):
        ...     print(line)
        rank 0, position 3: 0F1v2 uses version 2, but stage 0 has produced versions 0..1 here
        rank 0, position 4: 0B1v1 uses version 1, but its forward used version 2 (a backward uses its forward's weights)
    """
    problems: list[str] = []
    steps: dict[int, set[int]] = {}
    for r, actions in enumerate(schedule.actions):
        updates: Counter[int] = Counter()
        reduced: Counter[int] = Counter()
        forward: dict[tuple[int, int | None], int | None] = {}
        for p, a in enumerate(actions):
            where = f"rank {r}, position {p}: {a}"
            if a.op in _VERSIONED or a.op is Op.OPTIMIZER_STEP:
                if a.version is None:
                    problems.append(f"{where} has no weight version (every F, B and STEP of an "
                                    "asynchronous schedule has one)")
                    continue
            elif a.version is not None and not a.op.is_communication:
                problems.append(f"{where} carries a version, which only F, B, STEP and messages do")
            j, v = a.stage, a.version
            if a.op is Op.REDUCE_GRAD:
                reduced[j] += 1
            elif a.op is Op.OPTIMIZER_STEP:
                if v != updates[j] + 1:
                    problems.append(f"{where} should produce version {updates[j] + 1} (step "
                                    f"{updates[j] + 1} of stage {j} on this rank)")
                if len(schedule.ranks_of(j)) > 1 and reduced[j] <= updates[j]:
                    problems.append(f"{where} has no {Action(j, Op.REDUCE_GRAD)} since the last "
                                    "step (replicas update together)")
                updates[j] += 1
            elif a.op is Op.FORWARD and v is not None:
                if v > updates[j]:
                    problems.append(f"{where} uses version {v}, but stage {j} has produced "
                                    f"versions 0..{updates[j]} here")
                forward[(j, a.microbatch)] = v
            elif a.op is Op.BACKWARD and (j, a.microbatch) in forward:
                used = forward.pop((j, a.microbatch))
                if v != used:
                    problems.append(f"{where} uses version {v}, but its forward used version "
                                    f"{used} (a backward uses its forward's weights)")
        for j, count in updates.items():
            steps.setdefault(j, set()).add(count)
    problems += [
        f"the replicas of stage {j} (ranks {list(schedule.ranks_of(j))}) run different numbers of "
        f"steps {sorted(counts)}; they must update together"
        for j, counts in sorted(steps.items()) if len(counts) > 1
    ]
    return problems


def versions_held(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per (rank, stage), the most weight versions the stage keeps at once: its live
    weights plus every older version used by a micro-batch in flight or by a later
    forward.

    Example (PipeDream, 3 stages: stage ``j`` keeps ``K - j`` versions):
        >>> from pipetrain.schedule.async_stream import AsyncStream
        >>> versions_held(AsyncStream("pipedream", [1, 1, 1]).schedule(8))
        {(0, 0): 3, (1, 1): 2, (2, 2): 1}
    """
    peaks: dict[tuple[int, int], int] = {}
    for r, actions in enumerate(schedule.actions):
        for j in schedule.stages_of(r):
            mine = [(a.op, a.version) for a in actions if a.stage == j and a.version is not None]
            upcoming = [v for op, v in mine if op is Op.FORWARD]
            current, peak, users = 0, 1, Counter[int]()
            for op, version in mine:
                if op is Op.FORWARD:
                    users[upcoming.pop(0)] += 1
                elif op is Op.BACKWARD:
                    users[version] -= 1
                elif op is Op.OPTIMIZER_STEP:
                    current += 1
                floor = upcoming[0] if upcoming else current + 1
                kept = {v for v in range(current) if users[v] > 0 or v >= floor}
                peak = max(peak, len(kept) + 1)
            peaks[(r, j)] = peak
    return peaks
