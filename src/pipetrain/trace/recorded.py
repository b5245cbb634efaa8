"""Recorded timelines: the clock conventions, checking them, aligning the ranks' origins.

What the runtime records for one training step is, per rank, one
:class:`~pipetrain.schedule.TimedAction` per executed action, in the order it ran, with
``start`` and ``end`` in **seconds since a step origin**. The trace layer reads every
rank's actions of one step as a single timeline, so the ranks' times must be on one axis.

Convention the runtime follows (and what the trace layer assumes):

- **One shared origin per step.** Every rank measures its times from the same instant,
  the step origin. Threads of one process share ``time.perf_counter``, so passing the
  same ``origin`` to every rank's executor is enough. Processes do not share
  ``perf_counter`` (its reference point is undefined), so the origin is taken from the
  wall clock that all processes of a host share, ``time.time()``: one process (rank 0
  or the launcher) takes ``wall_origin = time.time()`` and sends it to the others, and
  each rank converts it to its own precise clock once per step,
  ``origin = time.perf_counter() - (time.time() - wall_origin)``, then times its actions
  with ``perf_counter`` as usual. Ranks on different hosts rely on the hosts' clocks
  being synchronized (NTP / PTP); their skew shows up as a shift of whole ranks.
- **Otherwise, per-rank origins plus offsets.** A rank that timed its actions from its
  own origin also records that origin on the shared wall clock (``time.time()`` at the
  origin); :func:`offsets_from_origins` turns those into per-rank offsets and
  :func:`align_ranks` shifts each rank's actions onto the earliest origin's axis.
- Times are seconds (floats). Each rank's actions are sequential in the order recorded;
  a receive spans the time the rank blocked for its message, a send the time it took
  to post it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pipetrain.schedule import TimedAction

__all__ = ["align_ranks", "check_timeline", "offsets_from_origins"]


def check_timeline(timeline: Iterable[TimedAction]) -> tuple[TimedAction, ...]:
    """The timeline as a tuple, after checking every action's rank, stage and times.

    Example:
        >>> from pipetrain.schedule import parse_action
        >>> len(check_timeline([TimedAction(0, parse_action("0F0"), 0.0, 0.5)]))
        1
        >>> check_timeline([TimedAction(0, parse_action("0F0"), 0.5, 0.25)])
        Traceback (most recent call last):
        ...
        ValueError: invalid recorded timeline: rank 0 action 0F0 ends before it starts (start=0.5, end=0.25); record end = clock() after the action ran

    Raises:
        ValueError: a negative rank or stage, a time that is not finite, or an action
            that ends before it starts (every problem is reported).
        TypeError: an item is not a :class:`~pipetrain.schedule.TimedAction`.
    """
    actions = tuple(timeline)
    problems = []
    for t in actions:
        if not isinstance(t, TimedAction):
            raise TypeError(
                f"a recorded timeline holds TimedAction(rank, action, start, end) items, got {t!r}"
            )
        where = f"rank {t.rank} action {t.action}"
        if t.rank < 0 or t.action.stage < 0:
            problems.append(f"{where}: rank and stage must be >= 0")
        elif not (math.isfinite(t.start) and math.isfinite(t.end)):
            problems.append(f"{where}: times must be finite, got start={t.start}, end={t.end}")
        elif t.end < t.start:
            problems.append(
                f"{where} ends before it starts (start={t.start}, end={t.end}); "
                f"record end = clock() after the action ran"
            )
    if problems:
        raise ValueError("invalid recorded timeline: " + "; ".join(problems))
    return actions


def offsets_from_origins(origins: Sequence[float]) -> tuple[float, ...]:
    """Per-rank offsets from each rank's step origin read on a shared wall clock.

    ``origins[r]`` is ``time.time()`` at rank ``r``'s origin; the offset of rank ``r``
    is how much later its origin was than the earliest one.

    Example:
        >>> offsets_from_origins([1700000000.25, 1700000000.0, 1700000000.5])
        (0.25, 0.0, 0.5)

    Raises:
        ValueError: an origin is not finite.
    """
    bad = [o for o in origins if not math.isfinite(o)]
    if bad:
        raise ValueError(f"origins must be finite wall-clock times (time.time()), got {bad[0]!r}")
    earliest = min(origins, default=0.0)
    return tuple(o - earliest for o in origins)


def align_ranks(
    timeline: Iterable[TimedAction], offsets: Sequence[float]
) -> tuple[TimedAction, ...]:
    """Shift each rank's actions by its offset, so every rank shares one time axis.

    Example:
        >>> from pipetrain.schedule import parse_action
        >>> aligned = align_ranks([TimedAction(1, parse_action("1F0"), 0.0, 1.0)], [0.0, 2.5])
        >>> aligned[0].start, aligned[0].end
        (2.5, 3.5)

    Raises:
        ValueError: a rank has no offset, or an offset is not finite.
    """
    actions = tuple(timeline)
    problems = [
        f"offset of rank {r} is {o!r}" for r, o in enumerate(offsets) if not math.isfinite(o)
    ]
    missing = sorted({t.rank for t in actions if not 0 <= t.rank < len(offsets)})
    if missing:
        problems.append(
            f"no offset for rank(s) {missing}: give one offset per rank "
            f"({len(offsets)} given, need {max(missing) + 1})"
        )
    if problems:
        raise ValueError("cannot align ranks: " + "; ".join(problems))
    return tuple(
        TimedAction(t.rank, t.action, t.start + offsets[t.rank], t.end + offsets[t.rank])
        for t in actions
    )
