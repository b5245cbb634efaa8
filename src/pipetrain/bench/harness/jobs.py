"""Launching a benchmark's ranks, and the collectives every benchmark needs.

:func:`run_job` spawns the ranks of a gloo job on 127.0.0.1 (``pipetrain.launch``), each
with one intra-op thread unless told otherwise; ``malloc_tuned``: each rank keeps the
memory it frees (:func:`pipetrain.runtime.host_memory.keep_freed_memory`, as ``pipetrain
train``'s CPU workers do: large temporaries do not page-fault every time; both
frameworks of a comparison alike). The environment is set for the spawned ranks only:
the caller's own stays as it was. Within :func:`forked_jobs` (``pipetrain bench
--quick``) the ranks are forked from a server that imported torch once instead: a job
starts in a fraction of a second, but settings read when a process starts (glibc's
malloc thresholds from the environment, ``EXACT_MALLOC``) are the server's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from pipetrain.runtime.host_memory import keep_freed_memory

__all__ = ["EXACT_MALLOC", "agree", "forked_jobs", "gather_objects",
           "ring_bandwidth", "run_job"]

EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
"""glibc malloc for measuring memory: every block of 64 KiB or more mapped on its own and
given back when freed (a fixed threshold also stops glibc from raising it after frees), so
that the resident set follows the tensors alive instead of what the heap kept after a free
(what a process ran before would otherwise change what it seems to need)."""
_START = ["spawn"]


@contextlib.contextmanager
def forked_jobs() -> Iterator[None]:
    """Within: :func:`run_job` forks its ranks from a fork server (``run_processes``'
    ``start="forkserver"``): for runs that check that a case works, not for measurements.

    Example::

        with forked_jobs():
            record = run_case("transport", quick=True, ...)
    """
    _START.append("forkserver")
    try:
        yield
    finally:
        _START.pop()


def run_job(fn: Callable[..., Any], *args: Any, world_size: int = 2, threads: int = 1,
            malloc_tuned: bool = False, timeout: float = 600.0) -> list[Any]:
    """``fn(context, *args)`` on ``world_size`` spawned ranks; their results by rank.

    Example::

        results = run_job(worker, opts, world_size=2, timeout=600)
    """
    from pipetrain.launch.processes import run_processes, temporary_environment

    env = {"OMP_NUM_THREADS": str(threads)}  # inherited by the spawned interpreters
    if malloc_tuned:  # in each rank itself: a forked rank does not read the environment
        fn, args = _keeping_freed_memory, (fn, *args)
    with temporary_environment(env):
        return run_processes(fn, world_size, *args, timeout=timeout, start=_START[-1])


def _keeping_freed_memory(context: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(context, *args)`` in a rank that keeps the memory it frees."""
    keep_freed_memory()
    return fn(context, *args)


def agree(local_ok: bool, message: str) -> list[str]:
    """Every rank's error message (none when all are fine): a collective, so that no
    rank runs on alone after another failed.

    Example (on every rank)::

        errors = agree(runner is not None, "could not build torch's schedule")
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, "" if local_ok else message)
    return [m for m in gathered if m]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (a picklable object), in rank order, on every rank."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def ring_bandwidth(nbytes: int, *, timed: int) -> float:
    """The job's ring all-reduce bandwidth in bytes per second, ``2 (r - 1) / r * nbytes /
    seconds`` for ``r`` ranks: the median of ``timed`` all-reduces of ``nbytes`` after one
    untimed, each started at a barrier. Every rank calls it.

    Example (on every rank of a job)::

        bandwidth = ring_bandwidth(16 * 2**20, timed=5)
    """
    import statistics
    import time

    import torch
    import torch.distributed as dist

    buffer = torch.ones(nbytes // 4)
    times = []
    for k in range(timed + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if k:
            times.append(time.perf_counter() - start)
    ranks = dist.get_world_size()
    return 2 * (ranks - 1) / ranks * nbytes / statistics.median(times)
