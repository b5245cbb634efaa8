"""The steady state of a schedule: time per micro-batch once the pipeline is full.

A synchronous schedule pays its fill and drain on every step: a step of ``M``
micro-batches takes ``makespan`` and a micro-batch costs ``makespan / M``. An
asynchronous schedule fills once and then streams: its cost per micro-batch is the
rate at which the input stage admits micro-batches in the middle of a long run. A
:class:`~pipetrain.api.pipeline.Pipeline` runs it one window per training step, and every
rank ends a step together (the step's loss is all-reduced): :func:`window_time` gives the
cost per micro-batch of such steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedule.actions import Op
from pipetrain.schedule.async_stream import AsyncStream
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.execution import TimedAction, execute
from pipetrain.schedule.lowering import add_communication
from pipetrain.schedule.program import Schedule

__all__ = ["SteadyState", "steady_state", "step_window", "window_time"]

_SENDER = {Op.RECV_FORWARD: (Op.SEND_FORWARD, -1), Op.RECV_BACKWARD: (Op.SEND_BACKWARD, 1)}


@dataclass(frozen=True)
class SteadyState:
    """Time per micro-batch: in the middle of the run (``steady``) and on average over
    the whole run, fill and drain included (``average = makespan / micro-batches``).

    Example:
        >>> SteadyState(steady=3.0, average=4.5).speedup_over(4.5)
        1.5
    """

    steady: float
    average: float

    def speedup_over(self, per_microbatch: float) -> float:
        """How many times faster than ``per_microbatch`` the steady state streams."""
        return per_microbatch / self.steady if self.steady > 0 else float("inf")


def steady_state(schedule: Schedule, timeline: tuple[TimedAction, ...]) -> SteadyState:
    """The steady state of a simulated (or measured) run of ``schedule``.

    ``steady`` is the time between the input stage's forwards of the micro-batches a
    quarter and three quarters into the run, per micro-batch between them (with
    uniform costs and no communication time: the slowest stage's forward plus backward
    divided by its replicas).

    Example (PipeDream on 4 stages, forward 1 and backward 2: a micro-batch every 3; a
    1F1B step of 8 micro-batches costs 33 / 8 per micro-batch):
        >>> from pipetrain.schedule.pipedream import pipedream
        >>> from pipetrain.schedule.simulate import simulate
        >>> s = pipedream(4, 64)
        >>> steady_state(s, simulate(s).timeline)
        SteadyState(steady=3.0, average=3.140625)

    Raises:
        ValueError: the run has fewer than 4 micro-batches (no middle to measure).
    """
    num = schedule.num_microbatches
    if num < 4:
        raise ValueError(f"a steady state needs a run of at least 4 micro-batches, got {num}; "
                         "fix: more micro-batches (or steps)")
    starts = {t.action.microbatch: t.start for t in timeline
              if t.action.op is Op.FORWARD and t.action.stage == 0}
    low, high = num // 4, (3 * num) // 4
    makespan = max(t.end for t in timeline) - min(t.start for t in timeline)
    return SteadyState(steady=(starts[high] - starts[low]) / (high - low), average=makespan / num)


def window_time(stream: AsyncStream, count: int, costs: Costs, *, warm: int = 2) -> float:
    """Time per micro-batch of a training step of ``count`` micro-batches in the steady
    state, when every rank starts the step together (after ``warm`` steps): the messages
    of earlier steps are there when it starts. Advances ``stream``.

    Example (PipeDream, 4 stages, forward 1 and backward 2: the end-of-step
    synchronization costs less than 1F1B's flush, 4.125 per micro-batch):
        >>> window_time(AsyncStream("pipedream", [1, 1, 1, 1]), 8, Costs())
        3.375
    """
    step = step_window(stream, count, warm=warm)
    timeline = execute(step, costs.per_stage(step.num_stages)).timeline
    return max(t.end for t in timeline) / count


def step_window(stream: AsyncStream, count: int, *, warm: int = 2) -> Schedule:
    """The training step of ``count`` micro-batches after ``warm`` others, as a schedule
    with its messages; receives whose message an earlier step sent are left out (it is
    there when the step starts), sends received by a later step stay. Advances ``stream``.

    Example:
        >>> print(step_window(AsyncStream("pipedream", [1, 1]), 2))
        rank 0: 0F4v3 0SF4v3 0B3v2 0STEPv4 0F5v4 0SF5v4 0RB4v3 0B4v3 0STEPv5
        rank 1: 1RF4v4 1F4v4 1B4v4 1SB4v4 1STEPv5 1RF5v5 1F5v5 1B5v5 1SB5v5 1STEPv6
    """
    for _ in range(warm):
        stream.window(count)
    schedule = add_communication(Schedule(
        name=stream.kind, num_microbatches=stream.admitted + count,
        stage_to_rank=tuple(group[0] for group in stream.groups),
        actions=tuple(tuple(acts) for acts in stream.window(count)),
        replicas=stream.groups if max(stream.replicas) > 1 else (),
    ))
    sent = {(a.op, a.stage, a.microbatch) for acts in schedule.actions for a in acts}
    return schedule.replace_actions([
        [a for a in acts if a.op not in _SENDER
         or (_SENDER[a.op][0], a.stage + _SENDER[a.op][1], a.microbatch) in sent]
        for acts in schedule.actions
    ])
