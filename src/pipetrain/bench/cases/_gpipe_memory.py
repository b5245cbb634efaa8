"""GPipe Table 1's trials: does a GPT of ``n`` blocks train under a memory cap per worker?

A *runner* trains the GPT of a :class:`Workload` for two steps (forward, backward,
``AdamW.step``: the second holds the optimizer's state, the steady peak), one of five
ways: ``naive`` (the ``nn.Sequential`` of the layers, every activation kept: the paper's
Naive-1), ``gpipe`` (``pipetrain.GPipe`` on one partition with ``checkpoint="always"``:
Pipeline-1), ``pipeline`` (``pipetrain.Pipeline`` over the job's K processes, schedule
``gpipe``, ``checkpoint="always"``: Pipeline-K), ``pipeline-per-layer`` (the same with
``checkpoint="per_layer"``: a micro-batch keeps its layers' inputs, a backward rebuilds
one layer at a time) or ``pipeline-fsdp`` (``pipeline-per-layer`` over K / 2 pipeline
ranks x 2 FSDP2 replicas, each replica half the micro-batches, with
``reshard_after_forward`` and ``reduce_each_microbatch``: every parameter, gradient and
optimizer state a worker keeps sharded). Every worker first trains the same
runner on a model of K blocks (code pages, allocator arenas and thread pools loaded
once), then measures the trial's peak: RSS growth above that warmed-up start
(:class:`~pipetrain.bench.harness.PeakMemory`). A trial fits if every worker's peak is
at most the cap.

Two ways to run trials: :func:`trial_worker` runs one trial in fresh processes
(:func:`fresh_search` searches with it, the full run: nothing of a smaller trial is left
in the process), with a watchdog thread
that ends the trial's processes (SIGKILL, by their ids) as soon as one grows past the
cap, leaving a note in ``marker_dir``; :func:`search_worker` runs whole searches in one
job (the quick run: no spawn per trial), counting what earlier trials left resident
(after ``malloc_trim``) against each later one.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipetrain.bench.cases._gpipe_search import largest_fitting
from pipetrain.bench.harness import PeakMemory, run_job
from pipetrain.launch import ProcessesFailed
from pipetrain.models import GPTConfig, build_gpt, gpt_layer_factories, gpt_loss

__all__ = ["RUNNER_KINDS", "Workload", "fresh_search", "same_size_peaks", "search_worker", "train",
           "trial_worker"]

RUNNER_KINDS = ("naive", "gpipe", "pipeline", "pipeline-per-layer", "pipeline-fsdp")
_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The GPT (fixed width, any depth), its batch, and the micro-batches of the
    re-materializing runners.

    Example:
        >>> Workload(width=64, heads=2, context=32, batch=8, microbatches=4).parameters(2)
        134912
    """

    width: int
    heads: int
    context: int
    batch: int
    microbatches: int

    def config(self, depth: int) -> GPTConfig:
        return GPTConfig(num_layers=depth, width=self.width, num_heads=self.heads,
                         context=self.context, tie_embeddings=False)

    def parameters(self, depth: int) -> int:
        """Parameters of the GPT of ``depth`` blocks."""
        return self.config(depth).parameters

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        shape = (self.batch, self.context)
        return (torch.randint(0, 256, shape, generator=generator),
                torch.randint(0, 256, shape, generator=generator))


def train(kind: str, depth: int, work: Workload, context: Any, *, steps: int = 2) -> None:
    """Build the ``kind`` runner of the GPT of ``depth`` blocks and train ``steps`` steps
    (``context``: the job's, from :func:`pipetrain.launch.run_processes`).

    Example (on every rank of a 2-process job)::

        train("pipeline", 8, Workload(width=64, heads=2, context=32, batch=16,
                                      microbatches=8), context)
    """
    import pipetrain

    x, y = work.tensors()
    if kind.startswith("pipeline") and kind in RUNNER_KINDS:
        replicas = 2 if kind == "pipeline-fsdp" else 1
        fsdp = {"data_parallel": "fsdp", "reshard_after_forward": True,
                "reduce_each_microbatch": True} if replicas > 1 else {}
        pipe = pipetrain.Pipeline(
            gpt_layer_factories(work.config(depth), seed=0), loss_fn=gpt_loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
            config=pipetrain.PipelineConfig(
                schedule="gpipe", num_stages=context.world_size // replicas,
                replicas=replicas, num_microbatches=work.microbatches // replicas,
                checkpoint="always" if kind == "pipeline" else "per_layer", **fsdp),
            context=context)
        with pipe:
            for _ in range(steps):
                pipe.train_step(x, y)
        return
    layers = build_gpt(work.config(depth), seed=0)
    model: torch.nn.Module = layers
    if kind == "gpipe":
        model = pipetrain.GPipe(layers, [len(layers)], devices=["cpu"],
                                chunks=work.microbatches, checkpoint="always")
    elif kind != "naive":
        raise ValueError(f"kind={kind!r} is not one of {RUNNER_KINDS}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        torch.autograd.backward(gpt_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Watchdog(threading.Thread):
    """Ends the trial's processes (ours, by id) once this one grows past the cap."""

    def __init__(self, *, cap_mib: float, pids: list[int], marker: Path) -> None:
        super().__init__(daemon=True)
        self.cap, self.pids, self.marker = cap_mib * _MIB, pids, marker
        self.start_bytes = _resident_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            grown = _resident_bytes() - self.start_bytes
            if grown > self.cap:
                # full precision (it exceeds the cap), written whole: a peer's watchdog may
                # kill this process mid-write, and a reader must never see an empty marker
                partial = self.marker.with_name(self.marker.name + ".partial")
                partial.write_text(repr(grown / _MIB))
                os.replace(partial, self.marker)
                for pid in [p for p in self.pids if p != os.getpid()] + [os.getpid()]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _warm_up(kind: str, work: Workload, context: Any) -> None:
    train(kind, max(1, context.world_size), work, context)
    gc.collect()


def _pids(context: Any) -> list[int]:
    import torch.distributed as dist

    pids: list[Any] = [None] * context.world_size
    dist.all_gather_object(pids, os.getpid())
    return [int(p) for p in pids]


def trial_worker(context: Any, kind: str, depth: int, work: Workload, cap_mib: float,
                 marker_dir: str) -> dict[str, Any]:
    """One trial in fresh processes (every rank of the job): the warm-up, then the
    trial under the watchdog; returns this rank's peak (MiB above the warmed-up start).

    Example::

        ranks = run_job(trial_worker, "pipeline", 64, work, 128.0, marker_dir, world_size=2)
    """
    _warm_up(kind, work, context)
    pids = _pids(context)
    meter = PeakMemory([torch.device("cpu")])
    meter.start()
    marker = Path(marker_dir) / f"rank{context.rank}.killed"
    watchdog = _Watchdog(cap_mib=cap_mib, pids=pids, marker=marker)
    watchdog.start()
    began = time.monotonic()
    try:
        train(kind, depth, work, context)
    finally:
        watchdog.done.set()
    return {"peak_mib": round(meter.peak_mib(), 1), "seconds": round(time.monotonic() - began, 2)}


def _in_job_trial(kind: str, depth: int, work: Workload, context: Any,
                  base: PeakMemory) -> dict[str, Any]:
    meter = PeakMemory([torch.device("cpu")])
    meter.start()
    left = max(0.0, base.peak_mib())  # what earlier trials left resident (VmHWM = VmRSS now)
    began = time.monotonic()
    error = None
    try:
        train(kind, depth, work, context)
    except MemoryError:
        error = "out of memory"
    except Exception as caught:  # reported and agreed on below: the search stops
        error = f"{type(caught).__name__}: {caught}"
    gc.collect()
    return {"peak_mib": round(meter.peak_mib() + left, 1), "left_mib": round(left, 1),
            "seconds": round(time.monotonic() - began, 2), "error": error}


def search_worker(context: Any, kinds: list[str], work: Workload, cap_mib: float,
                  starts: list[int], tolerance: float, limit: int) -> list[dict[str, Any]]:
    """Searches in one job (every rank of it): for each runner kind in turn, the largest
    depth whose trial fits on every rank; trials agree through an all-gather.

    Example::

        found = run_job(search_worker, ["naive", "gpipe"], work, 24.0, [4, 12], 0.25, 1024,
                        world_size=1)[0]
    """
    import torch.distributed as dist

    for kind in kinds:
        _warm_up(kind, work, context)
    base = PeakMemory([torch.device("cpu")])
    base.start()
    results = []
    for kind, start in zip(kinds, starts):
        records: list[dict[str, Any]] = []
        failure: list[str] = []

        def fits(depth: int, kind: str = kind, records: list[dict[str, Any]] = records,
                 failure: list[str] = failure) -> bool:
            mine = _in_job_trial(kind, depth, work, context, base)
            every: list[Any] = [None] * context.world_size
            dist.all_gather_object(every, mine)
            errors = [r["error"] for r in every if r["error"] not in (None, "out of memory")]
            if errors:
                failure.append(f"the trial of {depth} blocks failed: {errors[0]}")
            peak = max(r["peak_mib"] for r in every)
            ok = not errors and all(r["error"] is None for r in every) and peak <= cap_mib
            records.append({"depth": depth, "fits": ok, "peak_mib": [r["peak_mib"] for r in every],
                            "left_mib": [r["left_mib"] for r in every],
                            "seconds": max(r["seconds"] for r in every)})
            return ok

        def stop(failure: list[str] = failure) -> str | None:
            return failure[0] if failure else None

        found = largest_fitting(fits, start=start, limit=limit, tolerance=tolerance, stop=stop)
        results.append({"kind": kind, "search": found.to_dict(), "records": records})
    return results


def _fresh_trial(kind: str, workers: int, depth: int, work: Workload, *, cap_mib: float,
                 timeout: float, records: list[dict[str, Any]], failures: list[str]) -> bool:
    """One trial in fresh processes: fits, or not (the watchdog ended it past the cap)."""
    record: dict[str, Any] = {"depth": depth}
    records.append(record)
    with tempfile.TemporaryDirectory() as marks:
        try:
            ranks = run_job(trial_worker, kind, depth, work, cap_mib, marks,
                            world_size=workers, threads=1, timeout=timeout)
        except ProcessesFailed as failed:
            killed = [float(p.read_text()) for p in Path(marks).glob("*.killed")]
            if killed:
                record.update(fits=False, killed_above_mib=round(max(killed), 2))
            else:
                record.update(fits=False, error=str(failed)[-400:])
                failures.append(f"the trial of {depth} blocks failed: {str(failed)[-400:]}")
            return False
    peaks = [r["peak_mib"] for r in ranks]
    record.update(fits=max(peaks) <= cap_mib, peak_mib=peaks,
                  seconds=max(r["seconds"] for r in ranks))
    return bool(record["fits"])


def same_size_peaks(kinds: Sequence[str], depth: int, work: Workload, *, repeats: int,
                    timeout: float) -> dict[str, list[float]]:
    """Each single-worker runner's peak (MiB) at one size: ``repeats`` trials in fresh
    processes each, the kinds taking turns, no cap (what the searches cannot say: two
    searches stop at different sizes, each within its trials' noise of the cap).

    Example::

        same_size_peaks(("gpipe", "pipeline"), 31, work, repeats=3, timeout=240.0)
        # {'gpipe': [120.4, 123.4, 120.3], 'pipeline': [119.0, 120.7, 121.0]}
    """
    peaks: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            records: list[dict[str, Any]] = []
            _fresh_trial(kind, 1, depth, work, cap_mib=float(1 << 20), timeout=timeout,
                         records=records, failures=[])
            if records[0].get("peak_mib"):
                peaks[kind].append(max(records[0]["peak_mib"]))
    return peaks


def fresh_search(kind: str, workers: int, work: Workload, *, start: int, deadline: float,
                 cap_mib: float, tolerance: float, limit: int,
                 trial_timeout_s: float) -> dict[str, Any]:
    """The largest depth whose trial fits, every trial in fresh processes (the full run);
    the search and every trial's record.

    Example::

        result = fresh_search("gpipe", 1, work, start=16, deadline=time.monotonic() + 60,
                              cap_mib=128.0, tolerance=1 / 12, limit=4096,
                              trial_timeout_s=240.0)
        result["search"]["largest"]
    """
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    found = largest_fitting(
        lambda n: _fresh_trial(kind, workers, n, work, cap_mib=cap_mib,
                               timeout=trial_timeout_s, records=records, failures=failures),
        start=start, limit=limit, tolerance=tolerance, deadline=deadline,
        stop=lambda: failures[0] if failures else None)
    return {"kind": kind, "search": found.to_dict(), "records": records}
