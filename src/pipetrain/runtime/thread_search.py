"""The intra-op thread count of a CPU pipeline's own work, chosen by timing its first steps.

On a CPU, an operator on a small micro-batch can run slower on several threads than on
one: a parallel region's start, split and join cost more than the work they share (the
AmoebaNet-D of torchgpipe's benchmarks trains 4 micro-batches of 4 images about 1.3x faster
on one thread than on two on a 2-core machine, and the whole batch of 16 about 1.5x slower
on one). Which side of that line a model falls on depends on the model, the micro-batch
and the machine, so :class:`ThreadCountSearch` measures it: after a warm-up call, it
alternates the current count and its half over a few calls, keeps the half if it is
faster by a margin (then tries its half in turn), and settles. Its counts apply to the
phases that run on the caller's thread (see :class:`pipetrain.api.local_step.LocalPipeline`).

Example:
    >>> search = ThreadCountSearch(start=2, warmup=1, trials=1)
    >>> [search.next_count() for _ in range(1)]   # the warm-up call runs at the start
    [2]
    >>> search.record(2, 1.0)                     # (not counted: a warm-up)
    >>> search.next_count(), search.next_count()  # then the half and the start, in turn
    (1, 2)
    >>> search.record(1, 0.5); search.record(2, 1.0)
    >>> search.settled, search.best
    (True, 1)
"""

from __future__ import annotations

import statistics

__all__ = ["ThreadCountSearch"]


class ThreadCountSearch:
    """Chooses an intra-op thread count by timing calls at it and at its half.

    ``start``: the first count (torch's, as the caller has it); ``warmup``: calls run at
    ``start`` and not counted; ``trials``: calls timed at each of the two counts compared
    (alternating); ``margin``: how much faster (a fraction of the time) the half must be
    to be taken. ``fixed``: a count to use always (no search).

    :meth:`next_count` gives the count for the next call, :meth:`record` takes the time a
    call took at its count (calls may overlap: each reports the count it ran at).
    """

    def __init__(self, *, start: int | None = None, fixed: int | None = None, warmup: int = 1,
                 trials: int = 3, margin: float = 0.05) -> None:
        if fixed is not None:
            start = fixed
        if start is None or start < 1:
            raise ValueError(f"a thread count must be at least 1, got {start!r}")
        self.best = start
        """the fastest count measured so far (the one a settled search uses)"""
        self._challenger = start // 2 if fixed is None else 0
        self._warmup = warmup
        self._trials = trials
        self._margin = margin
        self._times: dict[int, list[float]] = {start: []}
        self._issued = 0

    @property
    def settled(self) -> bool:
        """Whether the search is over (every later call runs at :attr:`best`)."""
        return self._challenger < 1

    def next_count(self) -> int:
        """The count the next call runs at."""
        if self.settled or self._warmup > 0:
            return self.best
        self._issued += 1
        return self._challenger if self._issued % 2 == 1 else self.best

    def record(self, count: int, seconds: float) -> None:
        """A call that ran at ``count`` took ``seconds``; settles once both counts have
        ``trials`` times."""
        if self.settled:
            return
        if self._warmup > 0:
            self._warmup -= 1
            return
        if count not in (self.best, self._challenger):
            return  # a call from before the last change
        self._times.setdefault(count, []).append(seconds)
        best, challenger = self._times[self.best], self._times.get(self._challenger, [])
        if len(best) < self._trials or len(challenger) < self._trials:
            return
        if statistics.median(challenger) < (1.0 - self._margin) * statistics.median(best):
            self.best = self._challenger
            self._times = {self.best: challenger}
            self._challenger = self.best // 2
        else:
            self._challenger = 0
        self._issued = 0
