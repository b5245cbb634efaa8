"""V-Half and V-Min (Qi et al.): V schedules that hold a half / a third of 1F1B's activations.

"Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024) observes that a
schedule's activation memory is set by how long each micro-batch's stages stay alive
(forward run, weight gradient not yet): with two stages per rank folded into a V, a
micro-batch that goes down the ranks and straight back up is alive on every rank for
about ``4K`` ticks, and one micro-batch enters every ``6`` ticks (``F``, ``I`` and ``W``
of two stages), so a rank holds about ``2K/3`` half-stages, a third of 1F1B's ``2K``
(V-Min); letting them live twice as long gives a half (V-Half) with a smaller bubble.

:func:`v_capped` builds such a schedule for any ``K`` and ``M`` as a list schedule under
a memory cap: one tick per action (``F = I = W``), each rank runs at every tick the most
urgent action it may run, in this order: an input-gradient half (``I``: it unblocks the
ranks behind it; oldest micro-batch first, the V's way back first), a forward on the V's
way up (it brings the micro-batch to its loss), a forward on the way down (a new
micro-batch), a weight-gradient half (``W``: it fills what is left and frees a slot). A
forward runs only while the rank holds fewer than ``cap`` stage-micro-batches (forwards
on the way down: fewer than ``cap - 1``, one slot stays free for the way up, so that the
oldest micro-batch always gets back to its loss: no deadlock). Forwards of a stage run
in micro-batch order. Where the first stage's ``W`` follows its ``I`` right away, the two
run as one whole backward ``B`` (the first stage's input gradient goes to no one): a
whole backward holds less while it runs than an ``I`` that keeps its layers' output
gradients for the ``W``.
"""

from __future__ import annotations

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.program import Schedule, v_placement

__all__ = ["v_capped", "v_half", "v_half_cap", "v_min", "v_min_cap"]

FWD, INPUT, WEIGHT = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def v_half_cap(num_ranks: int) -> int:
    """V-Half's cap: ``K`` stage-micro-batches per rank (half-stages: half of 1F1B's ``K``
    full stages), at least 2 (a rank holds both of a micro-batch's stages at the V's turn).

    Example:
        >>> [v_half_cap(k) for k in (1, 2, 4, 8)]
        [2, 2, 4, 8]
    """
    return max(2, num_ranks)


def v_min_cap(num_ranks: int) -> int:
    """V-Min's cap: ``ceil((2K+1)/3)`` stage-micro-batches per rank (a third of 1F1B's
    ``2K`` half-stages, rounded up), at least 2.

    Example:
        >>> [v_min_cap(k) for k in (1, 2, 4, 8)]
        [2, 2, 3, 6]
    """
    return max(2, -(-(2 * num_ranks + 1) // 3))


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: the V placement at :func:`v_half_cap` (half of 1F1B's activation memory).

    Example (one column per clock tick, unit costs; cells name the stage):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(v_half(2, 2)))
        rank 0: 0F0 .   .   3F0 3I0 3W0 .   0B0 0F1 .   .   3F1 3I1 3W1 .   0B1
        rank 1: .   1F0 2F0 .   .   2I0 1I0 2W0 1W0 1F1 2F1 .   .   2I1 1I1 2W1 1W1

    Raises:
        ValueError: ``num_ranks`` or ``num_microbatches`` is below 1.
    """
    return v_capped(num_ranks, num_microbatches, cap=v_half_cap(num_ranks), name="v-half")


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: the V placement at :func:`v_min_cap` (about a third of 1F1B's activation
    memory; the same as V-Half's at ``K = 2``, where a rank cannot hold less than the two
    stages of the micro-batch at the V's turn).

    Raises:
        ValueError: ``num_ranks`` or ``num_microbatches`` is below 1.
    """
    return v_capped(num_ranks, num_microbatches, cap=v_min_cap(num_ranks), name="v-min")


def v_capped(num_ranks: int, num_microbatches: int, *, cap: int, name: str = "v-capped") -> Schedule:
    """The V schedule whose ranks never hold more than ``cap`` stage-micro-batches (see the
    module's docstring for the rule).

    Example:
        >>> from pipetrain.schedule.simulate import simulate
        >>> simulate(v_capped(4, 8, cap=3)).peak_activations
        (3, 3, 3, 3)

    Raises:
        ValueError: a count is below its minimum (``cap``: 2).
    """
    check_counts(
        {"num_ranks": (num_ranks, 1), "num_microbatches": (num_microbatches, 1), "cap": (cap, 2)},
        context=name,
    )
    k, m = num_ranks, num_microbatches
    last = 2 * k - 1
    done: dict[tuple[int, Op, int], int] = {}  # (stage, op, micro-batch) -> tick it ran
    next_forward = [0] * (2 * k)
    held = [0] * k
    owed: list[list[tuple[int, int]]] = [[] for _ in range(k)]  # (stage, micro-batch) I run
    actions: list[list[Action]] = [[] for _ in range(k)]
    tick, total = 0, 6 * k * m
    while len(done) < total:
        chosen: list[tuple[int, Op, int] | None] = []
        for r in range(k):
            down, up = r, last - r
            chosen.append(_choose(r, down, up, tick, done, next_forward, held[r], owed[r],
                                  cap=cap, num_microbatches=m, last=last))
        if not any(chosen):
            raise AssertionError(f"{name}: no rank can act at tick {tick} (cap {cap})")
        for r, choice in enumerate(chosen):
            if choice is None:
                continue
            stage, op, i = choice
            done[choice] = tick
            actions[r].append(Action(stage, op, i))
            if op is FWD:
                next_forward[stage] += 1
                held[r] += 1
            elif op is INPUT:
                owed[r].append((stage, i))
            else:
                owed[r].remove((stage, i))
                held[r] -= 1
        tick += 1
    return Schedule(name=name, num_microbatches=m, stage_to_rank=v_placement(k),
                    actions=tuple(_first_stage_whole(a) for a in actions))


def _first_stage_whole(actions: list[Action]) -> tuple[Action, ...]:
    """The first stage's ``I`` and ``W`` of a micro-batch, where one follows the other,
    as one ``B``: its input gradient goes to no one, so nothing waits for the ``I`` alone,
    and a whole backward holds less while it runs than an ``I`` that keeps its layers'
    output gradients for the ``W``."""
    fused: list[Action] = []
    for action in actions:
        if (action.stage == 0 and action.op is WEIGHT and fused
                and fused[-1] == Action(0, INPUT, action.microbatch)):
            fused[-1] = Action(0, Op.BACKWARD, action.microbatch)
        else:
            fused.append(action)
    return tuple(fused)


def _choose(
    rank: int, down: int, up: int, tick: int, done: dict[tuple[int, Op, int], int],
    next_forward: list[int], held: int, owed: list[tuple[int, int]], *, cap: int,
    num_microbatches: int, last: int,
) -> tuple[int, Op, int] | None:
    """The action rank ``rank`` runs at ``tick`` (``None``: it waits)."""

    def before(key: tuple[int, Op, int]) -> bool:
        return done.get(key, tick) < tick

    # I: oldest micro-batch first, the way up before the way down
    inputs = []
    for stage in (up, down):
        for i in range(num_microbatches):
            if (stage, INPUT, i) in done or (stage, FWD, i) not in done:
                continue
            if (stage == last and before((stage, FWD, i))) or (
                stage < last and before((stage + 1, INPUT, i))
            ):
                inputs.append((i, -stage))
            break  # a stage's backward inputs also run in micro-batch order
    if inputs:
        i, minus = min(inputs)
        return (-minus, INPUT, i)
    for stage, room in ((up, cap), (down, cap - 1)):
        i = next_forward[stage]
        if i >= num_microbatches or held >= room:
            continue
        if stage == 0 or before((stage - 1, FWD, i)):
            return (stage, FWD, i)
    if owed:
        stage, i = owed[0]
        if before((stage, INPUT, i)):
            return (stage, WEIGHT, i)
    return None
