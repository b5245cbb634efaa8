"""Readiness-driven order: a rank's action list as a hint, run whatever is ready.

In the fixed order a rank waits for its next action's message even when a later action
could run now. With :class:`ReadyOrder` the rank runs the first action *in list order*
that is ready and allowed; the rules keep the math, the memory bound and the progress of
the fixed order:

- Within a stage, forwards run in list order and backwards (``B`` and ``I``) in list
  order: every stage sees its micro-batches in the same order as in the fixed order, so
  gradients accumulate in the same order and batch norm's running statistics move alike.
- A forward may only pass forwards: a backward never waits behind a forward that ran
  early, so a rank never holds more micro-batches than the fixed order does at its peak.
  A backward may pass anything but a ``REDUCE``/``STEP`` of its own stage.
- ``W``, ``REDUCE`` and ``STEP`` run only at the head of the list: a ``W`` where the
  schedule put it to fill a gap (run early, it delays the action whose message was about
  to come), the collectives in the fixed order on every rank.
- The head of the list is always allowed: whatever the fixed order would run next runs
  as soon as it is ready, so a schedule that completes in the fixed order completes here.

Communication actions are dropped: sends go out as soon as their compute ends and a
receive is the readiness of the compute that consumes it.

Example:
    >>> from pipetrain.schedule.actions import parse_actions
    >>> order = ReadyOrder(parse_actions("1F0 1F1 1B0 1B1"))
    >>> order.done(order.pick(lambda a: True)); [str(a) for a in order.candidates()]
    ['1F1', '1B0']
    >>> arrived = {"1B0"}            # 1F1's input is late, 1B0's gradient is in
    >>> str(order.pick(lambda a: str(a) in arrived))
    '1B0'
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from pipetrain.schedule.actions import Action, Op

__all__ = ["ORDERS", "ReadyOrder", "check_order"]

ORDERS = ("fixed", "ready")
"""``fixed``: each rank runs its list in order; ``ready``: :class:`ReadyOrder`."""

_FORWARD, _BACKWARD, _WEIGHT = "F", "B", "W"
_CLASS = {Op.FORWARD: _FORWARD, Op.BACKWARD: _BACKWARD, Op.BACKWARD_INPUT: _BACKWARD,
          Op.BACKWARD_WEIGHT: _WEIGHT}
_BARRIERS = (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP, Op.UNSHARD, Op.RESHARD)


def check_order(order: str) -> str:
    """``order`` if it names an execution order, else a ``ValueError`` naming the choices.

    Example:
        >>> check_order("ready")
        'ready'
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not an execution order; choose one of "
                         f"{', '.join(ORDERS)} (ready: run whatever action is ready first)")
    return order


class ReadyOrder:
    """One rank's pending actions and which of them may run next (see the module).

    :meth:`pick` returns the first allowed action (in list order) for which ``ready(action)``
    is true; :meth:`done` marks it run. ``ready`` answers for the action's input only (its
    message has arrived, or it has none); the order of the stage's own actions is checked
    here.
    """

    def __init__(self, actions: Sequence[Action]) -> None:
        self._actions = [a for a in actions if not a.op.is_communication]
        self._done = [False] * len(self._actions)
        self._head = 0
        self._queues: dict[tuple[int, str], deque[int]] = {}
        self._barriers: dict[int, deque[int]] = {}
        self._others: deque[int] = deque()  # positions of everything but forwards
        for position, action in enumerate(self._actions):
            kind = _CLASS.get(action.op)
            if kind is not None and action.microbatch is not None:
                self._queues.setdefault((action.stage, kind), deque()).append(position)
            elif action.op in _BARRIERS:
                self._barriers.setdefault(action.stage, deque()).append(position)
            if kind != _FORWARD:
                self._others.append(position)
        self._forwarded: set[tuple[int, int]] = set()

    def __len__(self) -> int:
        return len(self._actions) - sum(self._done)

    def pending(self) -> list[Action]:
        """The actions not run yet, in list order."""
        return [a for a, done in zip(self._actions, self._done) if not done]

    def _allowed(self, position: int) -> bool:
        action = self._actions[position]
        if position == self._head:
            return True
        if action.op in _BARRIERS or action.microbatch is None:
            return False
        barriers = self._barriers.get(action.stage)
        if barriers and barriers[0] < position:
            return False
        key = (action.stage, action.microbatch)
        kind = _CLASS[action.op]
        if kind == _FORWARD:
            return not self._others or self._others[0] > position
        if kind == _BACKWARD:
            return key in self._forwarded
        return False  # a W runs at its place: the schedule put it where it fills a gap

    def candidates(self) -> list[Action]:
        """The actions allowed to run next, in list order (their inputs not checked)."""
        heads = {self._head}
        heads.update(queue[0] for queue in self._queues.values() if queue)
        return [self._actions[p] for p in sorted(heads)
                if p < len(self._actions) and not self._done[p] and self._allowed(p)]

    def pick(self, ready: Callable[[Action], bool]) -> Action | None:
        """The first allowed action whose input is ready, or ``None``."""
        for action in self.candidates():
            if ready(action):
                return action
        return None

    def done(self, action: Action) -> None:
        """Mark ``action`` (one returned by :meth:`candidates`) as run."""
        position = self._position(action)
        self._done[position] = True
        kind = _CLASS.get(action.op)
        if kind is not None and action.microbatch is not None:
            self._queues[(action.stage, kind)].popleft()
            key = (action.stage, action.microbatch)
            if kind == _FORWARD:
                self._forwarded.add(key)
        elif action.op in _BARRIERS:
            self._barriers[action.stage].popleft()
        if kind != _FORWARD:
            self._others.remove(position)
        while self._head < len(self._actions) and self._done[self._head]:
            self._head += 1

    def _position(self, action: Action) -> int:
        if self._head < len(self._actions) and self._actions[self._head] == action:
            return self._head
        kind = _CLASS.get(action.op)
        if kind is not None and action.microbatch is not None:
            queue = self._queues.get((action.stage, kind))
            if queue and self._actions[queue[0]] == action:
                return queue[0]
        raise ValueError(f"action {action} is not one that may run next; pending: "
                         f"{' '.join(map(str, self.pending()[:8]))}")
