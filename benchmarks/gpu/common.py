"""What every item of the GPU check shares: its context (device, sizes, time budget),
cases that catch their own failures, and the item's JSON record."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STATUSES", "ItemContext", "case_status", "error_text", "free_device_memory",
           "interleaved_times", "is_out_of_memory", "run_case", "run_command", "synchronize"]

STATUSES = ("ok", "failed", "skipped")
"""An item's (and a case's) outcome: ``skipped`` always comes with a reason."""


@dataclass(frozen=True, kw_only=True)
class ItemContext:
    """Where and how long one item runs.

    Example:
        >>> ctx = ItemContext(name="x", device="cpu", quick=True, out_dir="/tmp", budget_s=10)
        >>> ctx.left() > 9 and str(ctx.torch_device())
        'cpu'
    """

    name: str
    device: str
    """``"cpu"`` or ``"cuda"`` (the item uses ``cuda:0``)."""
    quick: bool
    """Small sizes (the CPU test's)."""
    out_dir: str
    budget_s: float
    """Seconds the item may take; it skips the cases that no longer fit, saying so."""
    started: float = field(default_factory=time.monotonic)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def torch_device(self) -> Any:
        import torch

        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def pick(self, sizes: dict[str, Any]) -> Any:
        """``sizes["cuda"]``, ``sizes["quick"]`` or ``sizes["cpu"]``, as this run is."""
        return sizes["cuda" if self.cuda else "quick" if self.quick else "cpu"]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.budget_s - self.elapsed()


def error_text(error: BaseException) -> str:
    """``Type: message`` of an error, on one line (the first 500 characters).

    Example:
        >>> error_text(ValueError("bad\\nvalue"))
        'ValueError: bad value'
    """
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is the allocator's out-of-memory.

    Example:
        >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
        True
    """
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        text = str(seen).lower()
        if type(seen).__name__ == "OutOfMemoryError" or "out of memory" in text \
                or "alloc_failed" in text:  # cuBLAS / cuDNN could not get their workspace
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: Any) -> int:
    """Collect garbage and return cached CUDA memory; the bytes still allocated (0 on
    the CPU)."""
    import torch

    gc.collect()
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def run_case(cases: list[dict[str, Any]], name: str, fn: Callable[[], dict[str, Any]],
             ctx: ItemContext, *, needs_s: float = 0.0) -> dict[str, Any]:
    """Run one case of an item, recording its figures or its failure in ``cases``; a
    case that no longer fits the item's budget (``needs_s`` seconds) is skipped, saying so.

    Example:
        >>> ctx = ItemContext(name="x", device="cpu", quick=True, out_dir="/tmp", budget_s=10)
        >>> cases = []
        >>> run_case(cases, "one", lambda: {"value": 1}, ctx)["status"]
        'ok'
        >>> run_case(cases, "two", lambda: 1 / 0, ctx)["reason"]
        'ZeroDivisionError: division by zero'
        >>> run_case(cases, "three", dict, ctx, needs_s=60)["status"]
        'skipped'
    """
    record: dict[str, Any] = {"case": name}
    if ctx.left() < needs_s:
        record.update(status="skipped", reason=f"time budget: {max(0.0, ctx.left()):.0f} s left "
                      f"of the item's {ctx.budget_s:.0f} s, the case needs about {needs_s:.0f} s")
        cases.append(record)
        return record
    began = time.monotonic()
    try:
        figures = fn()
        record.update(status=figures.pop("status", "ok"), **figures)
    except Exception as error:  # one case's failure is recorded, the others run
        record.update(status="failed", reason=error_text(error),
                      traceback=traceback.format_exc()[-3000:])
    record["seconds"] = round(time.monotonic() - began, 3)
    cases.append(record)
    return record


def case_status(cases: list[dict[str, Any]]) -> tuple[str, str | None]:
    """An item's status from its cases: failed if any failed, ok if any ran, else
    skipped (with the first case's reason).

    Example:
        >>> case_status([{"status": "ok"}, {"status": "skipped", "reason": "time"}])
        ('ok', None)
        >>> case_status([{"status": "ok"}, {"case": "b", "status": "failed", "reason": "E"}])
        ('failed', 'b: E')
    """
    failed = [c for c in cases if c.get("status") == "failed"]
    if failed:
        return "failed", "; ".join(f"{c.get('case')}: {c.get('reason')}" for c in failed)[:1000]
    if any(c.get("status") == "ok" for c in cases):
        return "ok", None
    if not cases:
        return "skipped", "no case ran"
    return "skipped", str(cases[0].get("reason"))


def interleaved_times(steps: dict[str, Callable[[], None]], *, warmup: int, rounds: int,
                      block: int) -> dict[str, list[float]]:
    """Seconds of each timed step of each runner: ``warmup`` untimed steps each, then
    ``rounds`` rounds that give every runner, in turn (the first one rotating), one
    untimed step and ``block`` timed ones; a slow spell hits all runners alike.

    Example:
        >>> times = interleaved_times({"a": lambda: None, "b": lambda: None}, warmup=1,
        ...                           rounds=2, block=3)
        >>> [len(t) for t in times.values()]
        [6, 6]
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            steps[name]()  # untimed: settles after the runner before it
            for _ in range(block):
                began = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - began)
    return times


def run_command(command: list[str], *, timeout: float, cwd: str) -> tuple[int | None, str]:
    """Run ``command`` in its own process group; its exit code (``None`` when it ran past
    ``timeout`` seconds and was ended, with everything it started) and its output.

    Example:
        >>> run_command(["echo", "hi"], timeout=10, cwd="/")
        (0, 'hi\\n')
    """
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = process.communicate(timeout=30)
        return None, output
