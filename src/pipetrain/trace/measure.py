"""Measured step figures: makespan, busy / idle / wait per rank, bubble, mean costs.

Computed from one step's recorded :class:`~pipetrain.schedule.TimedAction` of every rank
on one time axis (see :mod:`pipetrain.trace.recorded`), with the simulator's
definitions, so a measured step and a simulated one compare directly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pipetrain.schedule import Costs, Op, TimedAction
from pipetrain.trace.recorded import align_ranks, check_timeline

__all__ = ["COST_NAMES", "StepMeasure", "aggregate", "measure_step"]

_OP_COSTS = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward_input",
    Op.BACKWARD_WEIGHT: "backward_weight",
    Op.REDUCE_GRAD: "reduce",
    Op.OPTIMIZER_STEP: "step",
}
COST_NAMES: tuple[str, ...] = (*_OP_COSTS.values(), "communication", "send")
"""Keys of :attr:`StepMeasure.measured_costs`, named like the fields of
:class:`~pipetrain.schedule.Costs`."""

_BUSY_OPS = frozenset(
    {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP}
)
_RECEIVES = {Op.RECV_FORWARD: (Op.SEND_FORWARD, -1), Op.RECV_BACKWARD: (Op.SEND_BACKWARD, 1)}
_SENDS = (Op.SEND_FORWARD, Op.SEND_BACKWARD)


@dataclass(frozen=True, kw_only=True)
class StepMeasure:
    """What one step (or the median of several, see :func:`aggregate`) measured.

    Per-rank tuples are indexed by rank, per-stage ones by stage. The definitions are
    :class:`~pipetrain.schedule.SimulationResult`'s: ``busy`` is the time in compute
    actions (``F``/``B``/``I``/``W``) and optimizer steps (``STEP``); ``REDUCE`` is not
    counted, as the all-reduce runs in the background (the runtime's ``REDUCE`` only
    launches it, and its ``STEP`` waits for it to finish, so that wait counts as busy
    in a measured step); ``idle = makespan - busy``; ``wait`` is the time blocked in
    receives (``RF``/``RB``, part of ``idle``; the runtime's ``RB`` first rebuilds a
    checkpointed micro-batch's graph, so with checkpointing that recomputation is
    counted there too); ``bubble_fraction`` is ``sum(idle) / (num_ranks * makespan)``.

    ``measured_costs`` maps each name of :data:`COST_NAMES` to one mean per stage
    (``None`` where the stage ran no such action): the mean duration of its ``F``,
    ``B``, ``I``, ``W``, ``REDUCE``, ``STEP`` and send (``SF``/``SB``: ``send``)
    actions, and for ``communication`` the
    mean latency of the messages the stage sent, estimated from the receives that
    waited for them: a receive reached before its message was sent ends when the
    message arrives, so ``receive end - send end`` is the latency (the simulator's
    definition). That needs explicit ``SF``/``RF``/``SB``/``RB`` actions and aligned
    ranks; receives that found their message already there tell nothing and are
    skipped.

    Example:
        >>> from pipetrain.schedule import build_schedule, simulate
        >>> m = measure_step(simulate(build_schedule("gpipe", num_ranks=2, num_microbatches=2)).timeline)
        >>> m.makespan, m.busy, m.idle, m.bubble_fraction
        (9.0, (6.0, 6.0), (3.0, 3.0), 0.3333333333333333)
        >>> m.measured_costs["backward"]
        (2.0, 2.0)
    """

    makespan: float
    """Latest end minus earliest start over all ranks."""
    busy: tuple[float, ...]
    """Per rank: time in compute actions and ``STEP``."""
    idle: tuple[float, ...]
    """Per rank: ``makespan - busy``."""
    wait: tuple[float, ...]
    """Per rank: time blocked in receives."""
    bubble_fraction: float
    """Idle share of all ranks' time, ``sum(idle) / (num_ranks * makespan)``."""
    measured_costs: Mapping[str, tuple[float | None, ...]] = field(hash=False)
    """Per cost name of :data:`COST_NAMES`, one mean per stage (``None``: not measured)."""
    num_steps: int = 1
    """How many steps this measure summarizes (more than 1 after :func:`aggregate`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "measured_costs", MappingProxyType(dict(self.measured_costs)))

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return len(self.busy)

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.measured_costs["forward"])

    @property
    def mean_costs(self) -> Costs:
        """The measured per-stage means as simulator :class:`~pipetrain.schedule.Costs`.

        A stage that did not run an op the others ran gets the mean of the others (for
        ``backward``, its own ``backward_input + backward_weight`` first); an op no
        stage ran keeps the :class:`~pipetrain.schedule.Costs` default (``backward``:
        ``backward_input + backward_weight`` where those were measured, ``I``/``W``:
        half of ``backward``; ``communication``, ``send``, ``reduce``, ``step``: 0).

        Example:
            >>> from pipetrain.schedule import build_schedule, simulate
            >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
            >>> costs = measure_step(simulate(s, Costs(forward=(1, 2))).timeline).mean_costs
            >>> costs.forward, costs.backward, simulate(s, costs).makespan
            ((1.0, 2.0), (2.0, 4.0), 27.0)

        Raises:
            ValueError: no stage ran a forward (nothing to estimate costs from).
        """
        costs = self.measured_costs
        if all(v is None for v in costs["forward"]):
            raise ValueError(
                "cannot estimate costs: the measured step ran no forward action; measure a "
                "step that ran the schedule"
            )
        backward = costs["backward"]
        if any(b is None for b in backward):
            backward = tuple(
                b if b is not None or i is None or w is None else i + w
                for b, i, w in zip(backward, costs["backward_input"], costs["backward_weight"])
            )
        values: dict[str, tuple[float, ...]] = {}
        for name in COST_NAMES:
            filled = _fill(backward if name == "backward" else costs[name])
            if filled is not None:
                values[name] = filled
        return Costs(**values)

    def to_dict(self) -> dict[str, Any]:
        """The measure as JSON-ready data.

        Example:
            >>> from pipetrain.schedule import build_schedule, simulate
            >>> s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
            >>> measure_step(simulate(s).timeline).to_dict()["measured_costs"]["forward"]
            [1.0, 1.0]
        """
        return {
            "num_steps": self.num_steps,
            "makespan": self.makespan,
            "busy": list(self.busy),
            "idle": list(self.idle),
            "wait": list(self.wait),
            "bubble_fraction": self.bubble_fraction,
            "measured_costs": {name: list(self.measured_costs[name]) for name in COST_NAMES},
        }


def measure_step(
    timeline: Iterable[TimedAction],
    *,
    num_ranks: int | None = None,
    num_stages: int | None = None,
    offsets: Sequence[float] | None = None,
) -> StepMeasure:
    """Measure one step from every rank's recorded actions (see :class:`StepMeasure`).

    ``num_ranks`` / ``num_stages`` default to the highest rank / stage seen plus one;
    give them when some ranks or stages recorded nothing (they count as idle for the
    whole step). ``offsets`` (seconds, one per rank) shift each rank's times first,
    when ranks timed from different origins (see :func:`~pipetrain.trace.align_ranks`).

    Example:
        >>> from pipetrain.schedule import parse_action
        >>> steps = [TimedAction(0, parse_action("0F0"), 0.0, 0.002),
        ...          TimedAction(1, parse_action("1RF0"), 0.0, 0.003),
        ...          TimedAction(1, parse_action("1F0"), 0.003, 0.004)]
        >>> m = measure_step(steps)
        >>> m.makespan, m.busy, m.wait, m.bubble_fraction
        (0.004, (0.002, 0.001), (0.0, 0.003), 0.625)

    Raises:
        ValueError: an invalid action (see :func:`~pipetrain.trace.check_timeline`), a
            rank or stage beyond ``num_ranks`` / ``num_stages``, or a missing offset.
    """
    actions = check_timeline(timeline)
    if offsets is not None:
        actions = align_ranks(actions, offsets)
    seen_ranks = max((t.rank + 1 for t in actions), default=0)
    seen_stages = max((t.action.stage + 1 for t in actions), default=0)
    problems = [
        f"num_{what}s={given} but the timeline has {what} {seen - 1}; "
        f"pass num_{what}s={seen} or more"
        for what, given, seen in (
            ("rank", num_ranks, seen_ranks),
            ("stage", num_stages, seen_stages),
        )
        if given is not None and given < seen
    ]
    if problems:
        raise ValueError("cannot measure the step: " + "; ".join(problems))
    num_ranks = seen_ranks if num_ranks is None else num_ranks
    num_stages = seen_stages if num_stages is None else num_stages

    per_rank: list[list[TimedAction]] = [[] for _ in range(num_ranks)]
    for t in actions:
        per_rank[t.rank].append(t)
    makespan = max(t.end for t in actions) - min(t.start for t in actions) if actions else 0.0
    busy, wait = [], []
    for rank_actions in per_rank:
        busy.append(math.fsum(t.end - t.start for t in rank_actions if t.action.op in _BUSY_OPS))
        wait.append(math.fsum(t.end - t.start for t in rank_actions if t.action.op in _RECEIVES))
    idle = tuple(makespan - b for b in busy)
    total = num_ranks * makespan
    return StepMeasure(
        makespan=makespan,
        busy=tuple(busy),
        idle=idle,
        wait=tuple(wait),
        bubble_fraction=sum(idle) / total if total > 0 else 0.0,
        measured_costs=_measured_costs(actions, num_stages),
    )


def aggregate(measures: Iterable[StepMeasure]) -> StepMeasure:
    """The median over steps of every figure (per rank and per stage, element-wise).

    Medians are taken figure by figure (``None`` stage means are skipped), so the result
    resists outlier steps (the first, warming up), but ``idle`` need not equal
    ``makespan - busy`` exactly.

    Example:
        >>> from pipetrain.schedule import build_schedule, simulate, Costs
        >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
        >>> steps = [measure_step(simulate(s, Costs(forward=f)).timeline) for f in (1, 1, 5)]
        >>> summary = aggregate(steps)
        >>> summary.num_steps, summary.makespan, summary.measured_costs["forward"]
        (3, 15.0, (1.0, 1.0))

    Raises:
        ValueError: no measures, or measures with different numbers of ranks or stages.
    """
    items = tuple(measures)
    if not items:
        raise ValueError("aggregate() needs at least one StepMeasure, got none")
    shapes = {(m.num_ranks, m.num_stages) for m in items}
    if len(shapes) > 1:
        raise ValueError(
            f"cannot aggregate steps of different shapes (num_ranks, num_stages): "
            f"{sorted(shapes)}; pass num_ranks= and num_stages= to measure_step()"
        )

    def medians(rows: Iterable[tuple[float, ...]]) -> tuple[float, ...]:
        return tuple(statistics.median(column) for column in zip(*rows))

    def stage_medians(name: str) -> tuple[float | None, ...]:
        columns = zip(*(m.measured_costs[name] for m in items))
        return tuple(_median([v for v in column if v is not None]) for column in columns)

    return StepMeasure(
        makespan=statistics.median(m.makespan for m in items),
        busy=medians(m.busy for m in items),
        idle=medians(m.idle for m in items),
        wait=medians(m.wait for m in items),
        bubble_fraction=statistics.median(m.bubble_fraction for m in items),
        measured_costs={name: stage_medians(name) for name in COST_NAMES},
        num_steps=sum(m.num_steps for m in items),
    )


def _measured_costs(
    actions: Sequence[TimedAction], num_stages: int
) -> dict[str, tuple[float | None, ...]]:
    durations: dict[str, list[list[float]]] = {
        name: [[] for _ in range(num_stages)] for name in COST_NAMES
    }
    sent: dict[tuple[Op, int, int], float] = {}
    for t in actions:
        op, j, i = t.action.op, t.action.stage, t.action.microbatch
        if op in _OP_COSTS:
            durations[_OP_COSTS[op]][j].append(t.end - t.start)
        elif op in _SENDS and i is not None:
            sent[(op, j, i)] = t.end
            durations["send"][j].append(t.end - t.start)
    for t in actions:
        op, j, i = t.action.op, t.action.stage, t.action.microbatch
        if op not in _RECEIVES or i is None:
            continue
        send_op, step = _RECEIVES[op]
        sender = j + step
        send_end = sent.get((send_op, sender, i))
        if send_end is not None and t.start <= send_end and 0 <= sender < num_stages:
            durations["communication"][sender].append(max(0.0, t.end - send_end))
    return {
        name: tuple(_mean(values) for values in per_stage) for name, per_stage in durations.items()
    }


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _fill(values: tuple[float | None, ...]) -> tuple[float, ...] | None:
    """Missing stages get the mean of the measured ones; ``None`` if none was measured."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    default = math.fsum(known) / len(known)
    return tuple(default if v is None else v for v in values)
