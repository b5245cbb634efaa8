"""Run a function in several processes that form a gloo job on 127.0.0.1.

Every wait has a timeout, every process is joined (killed if it overstays), and the
port is chosen free, so a failing test never hangs or leaves processes behind.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["WorkerFailed", "free_port", "run_workers"]


class WorkerFailed(AssertionError):
    """A worker raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
           results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        from pipetrain.runtime.process_group import init_distributed

        ctx = init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                               master_port=port, timeout=60.0)
        value = fn(ctx, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:  # report everything, including SystemExit
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                expect_errors: bool = False) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; the results by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    With ``expect_errors`` the per-rank outcome is returned as ``("ok", value)`` or
    ``("error", text)`` instead of raising.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
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
    missing = [r for r in range(world_size) if r not in outcome]
    if expect_errors:
        return [outcome.get(r, ("missing", None)) for r in range(world_size)]
    if missing:
        raise WorkerFailed(f"ranks {missing} gave no result within {timeout} s "
                           f"(exit codes {[p.exitcode for p in procs]})")
    errors = {r: payload for r, (status, payload) in outcome.items() if status != "ok"}
    if errors:
        raise WorkerFailed("\n".join(f"rank {r}:\n{text}" for r, text in sorted(errors.items())))
    return [outcome[r][1] for r in range(world_size)]
