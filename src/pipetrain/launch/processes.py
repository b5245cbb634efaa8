"""Running a function on every rank of a small local job (spawned processes, gloo).

For tests, benchmarks and notebooks: ``run_processes(fn, 2, ...)`` starts two fresh
interpreters (or, with ``start="forkserver"``, forks them from a server that imported torch
once), joins them into a gloo job on 127.0.0.1 (free port) through
:func:`pipetrain.runtime.process_group.init_distributed`, calls ``fn(context, *args)`` on
each, and returns the results by rank. Every wait has a timeout and every process is
joined (killed if it overstays), so a failing job never hangs its caller.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["ProcessesFailed", "free_port", "run_processes", "temporary_environment"]


class ProcessesFailed(AssertionError):
    """A rank raised or gave no result; the message holds each rank's traceback."""


@contextmanager
def temporary_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` (what processes started meanwhile inherit), and
    the previous values (or their absence) put back after.

    Example:
        >>> with temporary_environment({"PIPETRAIN_EXAMPLE": "1"}):
        ...     os.environ["PIPETRAIN_EXAMPLE"]
        '1'
        >>> "PIPETRAIN_EXAMPLE" in os.environ
        False
    """
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now.

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint.state_dict",
            "pipetrain.api.pipeline", "pipetrain.runtime.process_group"]
"""What the fork server imports once, so that the ranks it forks start without importing."""

_STARTS = ("spawn", "forkserver")


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float,
           args: tuple[Any, ...], results: Any, environment: dict[str, str] | None) -> None:
    if environment is not None:  # forked from the server: the caller's environment now
        os.environ.clear()
        os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        from pipetrain.runtime.process_group import init_distributed

        context = init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                   master_port=port, timeout=timeout)
        value = fn(context, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:  # report everything, SystemExit included
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    expect_errors: bool = False,
    start: str = "spawn",
) -> list[Any]:
    """Run ``fn(context, *args)`` on ``world_size`` spawned ranks; the results by rank.

    ``fn`` must be importable by name (a module-level function): the ranks are fresh
    interpreters. ``start="forkserver"`` forks them instead from a server process that
    imported torch and pipetrain once (started on first use, kept for later jobs): a rank
    starts in a fraction of a second instead of seconds. Each rank sees ``os.environ`` as it
    is at the call, but settings a library reads when it loads (OpenMP's) are the server's:
    keep ``"spawn"`` to measure, or to vary such settings between jobs. With
    ``expect_errors`` each rank's outcome is returned as ``("ok", value)``, ``("error",
    traceback text)`` or ``("missing", None)`` instead of raising. Each rank runs with ``OMP_NUM_THREADS`` (default 1) intra-op threads.

    Raises:
        ProcessesFailed: a rank raised, or gave no result within ``timeout`` seconds.

    Example::

        def loss_on_each_rank(context, steps):
            ...
        losses = run_processes(loss_on_each_rank, 2, 10, timeout=300)
    """
    import torch.multiprocessing as mp

    if start not in _STARTS:
        raise ValueError(f"start={start!r} is not a way to start ranks; fix: one of {_STARTS}")
    context: Any = mp.get_context(start)  # spawn or forkserver: both have Process
    environment = None
    if start == "forkserver":
        context.set_forkserver_preload(_PRELOAD)  # read when the server starts, once
        environment = dict(os.environ)
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_entry, args=(fn, r, world_size, port, timeout, args, results,
                                             environment), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcome[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if expect_errors:
        return [outcome.get(r, ("missing", None)) for r in range(world_size)]
    missing = [r for r in range(world_size) if r not in outcome]
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in sorted(outcome.items()) if status != "ok"]
    if errors or missing:
        raise ProcessesFailed(
            "\n".join(errors)
            + (f"\nranks {missing} gave no result within {timeout:.0f} s "
               f"(exit codes {[p.exitcode for p in procs]})" if missing else "")
        )
    return [outcome[r][1] for r in range(world_size)]
