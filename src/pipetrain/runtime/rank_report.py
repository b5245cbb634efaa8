"""Where a rank is when a job hangs or fails: the action it runs, since when, the message
it waits for (kind, micro-batch, the stage and rank that should send it) and the actions it
completed last. ``pipetrain train``'s workers write it into the run folder when a step
fails (``hang/rank<R>.json``), and the launcher names the rank(s) the job was stuck on.
"""

from __future__ import annotations

import time
from typing import Any

from pipetrain.runtime.transport import ACTIVATION, GRADIENT
from pipetrain.schedule import Action, Op

__all__ = ["awaited", "rank_report"]

_COLLECTIVES = (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP, Op.UNSHARD)


def awaited(executor: Any, action: Action) -> dict[str, Any] | None:
    """The message ``action`` waits for on ``executor``'s rank (None: none from a peer).

    Example:
        >>> from pipetrain.runtime.executor import Placement
        >>> from pipetrain.schedule import parse_actions
        >>> class Rank:  # a rank holding stage 1 of 2
        ...     rank, num_stages, placement = 1, 2, Placement.single([0, 1])
        ...     def _local(self, stage, microbatch): return stage == 1
        >>> awaited(Rank(), parse_actions("1F3")[0])
        {'kind': 'activation', 'microbatch': 3, 'from_stage': 0, 'from_rank': 0}
    """
    j, i = action.stage, action.microbatch
    if action.op in _COLLECTIVES:
        return {"kind": "collective", "of_stage": j}
    if i is None:
        return None
    if action.op in (Op.RECV_FORWARD, Op.FORWARD) and j > 0 and not executor._local(j - 1, i):
        kind, source = ACTIVATION, j - 1
    elif (action.op in (Op.RECV_BACKWARD, Op.BACKWARD, Op.BACKWARD_INPUT)
          and j < executor.num_stages - 1 and not executor._local(j + 1, i)):
        kind, source = GRADIENT, j + 1
    else:
        return None
    return {"kind": kind, "microbatch": i, "from_stage": source,
            "from_rank": executor.placement.rank(source, i)}


def rank_report(executor: Any, *, step: int | None = None) -> dict[str, Any]:
    """What ``executor``'s rank is doing: ``rank``, ``step`` (the steps completed), ``action``
    (running or failed, or None between steps), ``seconds`` in it, ``waits_for`` (see
    :func:`awaited`) and ``done`` (the last actions completed, oldest first).

    Example:
        >>> from pipetrain.runtime.executor import Placement
        >>> class Idle:
        ...     rank, current, recent = 0, None, ["0F0", "0B0"]
        >>> rank_report(Idle(), step=3)
        {'rank': 0, 'step': 3, 'action': None, 'seconds': None, 'waits_for': None, 'done': ['0F0', '0B0']}
    """
    current = executor.current
    report: dict[str, Any] = {"rank": executor.rank, "step": step, "action": None,
                              "seconds": None, "waits_for": None,
                              "done": [str(a) for a in list(executor.recent)]}
    if current is not None:
        action, since = current
        report.update(action=str(action), seconds=round(time.monotonic() - since, 1),
                      waits_for=awaited(executor, action))
    return report
