"""Execution under jitter: seeded per-action delays, a slow rank, a slow link, in either order.

:func:`execute_order` plays a schedule the way the runtime runs it, with communication
implicit (a compute action's message leaves when it ends and arrives ``communication``
later), in the fixed order or readiness-driven (:class:`~.readiness.ReadyOrder`), each
compute action of the ranks :class:`Jitter` slows taking longer by a seeded random share.
The delay of an action depends only on the seed, the rank and the action, never on when
it runs, so both orders meet the same delays and compare fairly.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from pipetrain.schedule.actions import Action, Op
from pipetrain.schedule.costs import StageCosts
from pipetrain.schedule.execution import Execution, TimedAction
from pipetrain.schedule.program import Schedule
from pipetrain.schedule.readiness import ReadyOrder, check_order

__all__ = ["Jitter", "execute_order"]


@dataclass(frozen=True, kw_only=True)
class Jitter:
    """Seeded slow-downs: each compute action of ``ranks`` (``None``: every rank) takes
    ``1 + u * delay`` times its cost, ``u`` uniform in [0, 1) drawn from (``seed``, rank,
    action); every message sent by ``ranks`` arrives ``link`` later.

    Example:
        >>> from pipetrain.schedule.actions import parse_action
        >>> j = Jitter(delay=0.4, ranks=(1,), seed=3)
        >>> 1.0 <= j.factor(1, parse_action("1F0")) < 1.4, j.factor(0, parse_action("0F0"))
        (True, 1.0)
    """

    delay: float = 0.0
    ranks: tuple[int, ...] | None = None
    link: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay", "link"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Jitter({name}={value!r}): give a finite number >= 0")

    @classmethod
    def parse(cls, text: str) -> Jitter:
        """Read ``delay=0.4,ranks=1:2,link=0.1,seed=3`` (any of them; ``ranks`` omitted:
        every rank).

        Example:
            >>> Jitter.parse("delay=0.4,ranks=1")
            Jitter(delay=0.4, ranks=(1,), link=0.0, seed=0)
            >>> Jitter.parse("delays=1")
            Traceback (most recent call last):
            ...
            ValueError: jitter 'delays=1': give name=value pairs of delay, ranks, link, seed; e.g. delay=0.4,ranks=1,seed=0
        """
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = (s.strip() for s in item.partition("="))
            try:
                if name in ("delay", "link") and name not in values:
                    values[name] = float(value)
                elif name == "seed" and name not in values:
                    values[name] = int(value)
                elif name == "ranks" and name not in values:
                    values[name] = tuple(int(r) for r in value.split(":"))
                else:
                    raise ValueError(name)
            except ValueError:
                raise ValueError(f"jitter {text!r}: give name=value pairs of delay, ranks, link, "
                                 "seed; e.g. delay=0.4,ranks=1,seed=0") from None
        return cls(**values)  # type: ignore[arg-type]

    def slowed(self, rank: int) -> bool:
        """Whether ``rank`` is one of the slowed ranks."""
        return self.ranks is None or rank in self.ranks

    def factor(self, rank: int, action: Action) -> float:
        """How many times its cost ``action`` takes on ``rank``."""
        if not self.delay or not self.slowed(rank):
            return 1.0
        u = zlib.crc32(f"{self.seed}/{rank}/{action}".encode()) / 2**32
        return 1.0 + u * self.delay


def execute_order(schedule: Schedule, costs: StageCosts, *, order: str = "ready",
                  jitter: Jitter | None = None, patience: float = 0.5) -> Execution:
    """Run ``schedule`` under ``costs`` in ``order`` (``fixed`` or ``ready``), with ``jitter``.

    In the ``ready`` order a rank whose next action waits for its message runs a later
    ready action only once it has waited ``patience`` times the waiting action's cost (an
    action that runs early delays the one whose message was about to arrive).

    Sends cost nothing here (the runtime posts them from compute); ``REDUCE`` runs in the
    background and its stage's ``STEP`` waits for it, as in :func:`~.execution.execute`.

    Example:
        >>> from pipetrain.schedule.costs import Costs
        >>> from pipetrain.schedule.one_f_one_b import one_f_one_b
        >>> s = one_f_one_b(2, 4)
        >>> def makespan(order, jitter=None):
        ...     run = execute_order(s, Costs().per_stage(2), order=order, jitter=jitter)
        ...     return round(max(t.end for t in run.timeline), 3)
        >>> makespan("fixed") == makespan("ready") == 15.0
        True
    """
    check_order(order)
    jitter = jitter or Jitter()
    num_stages = schedule.num_stages
    orders = [ReadyOrder(actions) for actions in schedule.actions]
    arrival: dict[tuple[str, int, int], float] = {}
    reduce_end: dict[int, float] = {}
    busy_until = [0.0] * len(orders)
    timeline: list[TimedAction] = []
    events = [(0.0, r) for r in range(len(orders))]
    heapq.heapify(events)

    def ready_at(t: float) -> Callable[[Action], bool]:
        def ready(action: Action) -> bool:
            j, i = action.stage, action.microbatch
            if action.op is Op.FORWARD and j > 0 and i is not None:
                return arrival.get(("A", j, i), math.inf) <= t
            if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and j < num_stages - 1 \
                    and i is not None:
                return arrival.get(("G", j, i), math.inf) <= t
            return True
        return ready

    def publish(key: tuple[str, int, int], stage: int, rank: int, dst: int, end: float) -> None:
        link = costs.communication[stage] + (jitter.link if jitter.slowed(rank) else 0.0)
        at = end if dst == rank else end + link
        arrival[key] = at
        heapq.heappush(events, (at, dst))

    waiting_since: dict[int, float] = {}  # when a rank's head began to wait

    per_op = {Op.FORWARD: costs.forward, Op.BACKWARD: costs.backward,
              Op.BACKWARD_INPUT: costs.backward_input, Op.BACKWARD_WEIGHT: costs.backward_weight}

    def cost_of(action: Action) -> float:
        table = per_op.get(action.op)
        return table[action.stage] if table else 0.0

    while events:
        t, r = heapq.heappop(events)
        if t < busy_until[r] or not len(orders[r]):
            continue
        ready = ready_at(t)
        head = orders[r].candidates()[0]
        action: Action | None = head
        if not ready(head):
            since = waiting_since.setdefault(r, t)
            action = orders[r].pick(ready) if order == "ready" else None
            until = since + patience * cost_of(head)
            if action is not None and t < until:
                heapq.heappush(events, (until, r))  # wait a little longer for the head
                continue
        if action is None:
            continue  # an arrival wakes the rank
        waiting_since.pop(r, None)
        orders[r].done(action)
        op, j, i = action.op, action.stage, action.microbatch
        start = t
        if op is Op.REDUCE_GRAD:
            reduce_end[j] = t + costs.reduce[j]
            timeline.append(TimedAction(r, action, t, reduce_end[j]))
            heapq.heappush(events, (t, r))
            continue
        if op is Op.OPTIMIZER_STEP:
            start = max(t, reduce_end.get(j, t))
            duration = costs.step[j]
        else:
            duration = cost_of(action) * jitter.factor(r, action)
        end = start + duration
        timeline.append(TimedAction(r, action, start, end))
        busy_until[r] = end
        heapq.heappush(events, (end, r))
        if i is not None and op is Op.FORWARD and j + 1 < num_stages:
            publish(("A", j + 1, i), j, r, schedule.rank_of(j + 1, i), end)
        elif i is not None and op in (Op.BACKWARD, Op.BACKWARD_INPUT) and j > 0:
            publish(("G", j - 1, i), j, r, schedule.rank_of(j - 1, i), end)
    if any(len(o) for o in orders):
        left = {r: ' '.join(map(str, o.pending()[:4])) for r, o in enumerate(orders) if len(o)}
        raise RuntimeError(f"the {order} order of {schedule.name!r} stopped with actions "
                           f"left: {left}")
    return Execution(tuple(sorted(timeline, key=lambda a: (a.rank, a.start))), ())
