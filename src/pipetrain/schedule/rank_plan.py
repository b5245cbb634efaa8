"""A rank's action list written step by step: micro-batches are counted for the writer.

The handcrafted schedules (ZB-V, DualPipe-V) are described in their papers as phases
of "the next forward of this stage, the next backward of that one"; :class:`RankPlan`
turns such a description into actions by keeping, per stage, the next micro-batch of
each kind of work and the queue of weight gradients (``W``) still owed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pipetrain.schedule.actions import Action, Op

__all__ = ["RankPlan"]


class RankPlan:
    """One rank's actions, built from "the next (stage, op)" steps.

    ``F`` takes the stage's next forward micro-batch; ``B`` and ``I`` share the stage's
    next backward micro-batch (a micro-batch gets a full ``B`` or a split ``I``); ``I``
    also owes a ``W``, which :meth:`weight` pays (oldest first). Micro-batches at or
    above ``num_microbatches`` are counted but left out of :attr:`actions`: a schedule
    shaped for more micro-batches than a step has keeps its order for the ones it has
    (each micro-batch's actions are dropped whole, so a valid order stays valid).

    Example:
        >>> plan = RankPlan(2)
        >>> plan.run([(0, Op.FORWARD)] * 3)
        >>> plan.add(0, Op.BACKWARD_INPUT)
        >>> plan.add(0, Op.BACKWARD)
        >>> plan.weight()
        >>> [str(a) for a in plan.actions]  # 0F2 is counted, but the step has 2 micro-batches
        ['0F0', '0F1', '0I0', '0B1', '0W0']
    """

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self._next: dict[tuple[int, str], int] = {}
        self._owed: deque[tuple[int, int]] = deque()
        self._actions: list[Action] = []

    def add(self, stage: int, op: Op) -> None:
        """Append ``op`` (``F``, ``B``, ``I`` or ``W``) on the stage's next micro-batch
        for that kind of work; ``W`` pays the stage's oldest owed weight gradient."""
        if op is Op.BACKWARD_WEIGHT:
            self.weight(stage)
            return
        kind = "F" if op is Op.FORWARD else "B"
        i = self._next.get((stage, kind), 0)
        self._next[(stage, kind)] = i + 1
        if op is Op.BACKWARD_INPUT:
            self._owed.append((stage, i))
        self._emit(Action(stage, op, i))

    def run(self, steps: Iterable[tuple[int, Op]]) -> None:
        """:meth:`add` each ``(stage, op)`` in turn."""
        for stage, op in steps:
            self.add(stage, op)

    def weight(self, stage: int | None = None) -> None:
        """Append the oldest owed ``W`` (of ``stage``, or of any stage); none owed: nothing."""
        for position, (j, i) in enumerate(self._owed):
            if stage is None or j == stage:
                del self._owed[position]
                self._emit(Action(j, Op.BACKWARD_WEIGHT, i))
                return

    @property
    def owed(self) -> int:
        """Weight gradients owed (``I`` run, ``W`` not yet)."""
        return len(self._owed)

    @property
    def actions(self) -> tuple[Action, ...]:
        """The actions so far (micro-batches of the step only)."""
        return tuple(self._actions)

    def _emit(self, action: Action) -> None:
        assert action.microbatch is not None
        if action.microbatch < self.num_microbatches:
            self._actions.append(action)
