"""Item ``max_model_size``: the row of GPipe's Table 1 that one device can show.

The largest GPT (fixed width, growing depth: number of transformer blocks) that trains
with AdamW on the device under a fixed memory cap, with and without
re-materialization: ``GPipe(model, [all layers], devices=[device], chunks=M,
checkpoint=...)`` on one partition, ``"always"`` (only each micro-batch's input is kept;
its activations are recomputed in backward, one micro-batch at a time) against
``"never"`` (every micro-batch's activations kept until backward), same batch, same
micro-batches. GPipe's Table 1 shows the same comparison on one accelerator
(Pipeline-1 vs Naive-1).

A depth trains if two training steps (forward, backward, ``AdamW.step``: the second
step holds the optimizer's state, the steady peak) finish under the cap. On CUDA the
cap is the allocator's (``torch.cuda.set_per_process_memory_fraction``, for this item's
process only) and a depth that does not train raises out-of-memory; on the CPU nothing
enforces a cap, so a depth trains if the step's measured peak (RSS growth from before
the model is built, ``pipetrain.bench.harness.memory``) stays under a small cap. The search
doubles the depth from 1 until a depth does not train, then bisects. Reported:
depths, parameter counts (``pipetrain.models.count_parameters``), their ratio, and
every trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpu.common import ItemContext, error_text, free_device_memory, is_out_of_memory

__all__ = ["SIZES", "largest", "run"]

SIZES = {
    "cuda": {"width": 1024, "heads": 16, "seq": 512, "batch": 16, "chunks": 16,
             "cap_gib": 6.0, "limit": 256},
    "cpu": {"width": 128, "heads": 4, "seq": 64, "batch": 16, "chunks": 4,
            "cap_mib": 96.0, "limit": 64},
    "quick": {"width": 64, "heads": 2, "seq": 128, "batch": 16, "chunks": 4,
              "cap_mib": 32.0, "limit": 16},
}
MODES = {"without_rematerialization": "never", "with_rematerialization": "always"}


def largest(fits: Callable[[int], bool], *, limit: int,
            out_of_time: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """The largest ``n`` in ``1..limit`` with ``fits(n)`` (``fits`` is taken to be
    monotone): doubling from 1 until ``n`` does not fit, then bisection.

    Example:
        >>> found = largest(lambda n: n <= 13, limit=100)
        >>> found["largest"], found["first_too_large"], [n for n, _ in found["trials"]]
        (13, 14, [1, 2, 4, 8, 16, 12, 14, 13])
        >>> largest(lambda n: True, limit=5)["largest"]
        5
    """
    trials: list[tuple[int, bool]] = []
    good, bad = 0, None
    n = 1
    complete = True
    while True:
        if out_of_time():
            complete = False
            break
        ok = fits(n)
        trials.append((n, ok))
        if not ok:
            bad = n
            break
        good = n
        if n >= limit:
            break
        n = min(2 * n, limit)
    while complete and bad is not None and bad - good > 1:
        if out_of_time():
            complete = False
            break
        middle = (good + bad) // 2
        ok = fits(middle)
        trials.append((middle, ok))
        if ok:
            good = middle
        else:
            bad = middle
    return {"largest": good, "first_too_large": bad, "trials": trials,
            "complete": complete, "reached_limit": bad is None and good == limit}


def _config(sizes: dict[str, Any], depth: int) -> Any:
    from pipetrain.models import GPTConfig

    return GPTConfig(num_layers=depth, width=sizes["width"], num_heads=sizes["heads"],
                     context=sizes["seq"], tie_embeddings=False)


def parameters(sizes: dict[str, Any], depth: int) -> int:
    """Parameters of the GPT of ``depth`` blocks (built on the meta device)."""
    import torch

    from pipetrain.models import build_gpt, count_parameters

    with torch.device("meta"):
        return count_parameters(build_gpt(_config(sizes, depth), seed=0))


LEAK_BYTES = 64 * 2**20
"""Memory left allocated after trials, above the first trial's start, that stops a search."""


def _clear_cublas_workspaces(device: Any) -> None:
    """Free cuBLAS's workspaces (one per stream, kept in the allocator: each GPipe's new
    streams would add some, shrinking later trials' room under the cap). Uses torch's
    private ``_cuda_clearCublasWorkspaces`` where it exists (what
    ``torch.cuda.empty_cache`` does not free); a measurement's hygiene, nothing more."""
    import torch

    if torch.device(device).type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            torch.cuda.synchronize(device)
            clear()


class _Trial:
    """Trains the GPT of a given depth for two steps under the cap."""

    def __init__(self, ctx: ItemContext, sizes: dict[str, Any], checkpoint: str) -> None:
        import torch

        self.ctx, self.sizes, self.checkpoint = ctx, sizes, checkpoint
        self.device = ctx.torch_device()
        generator = torch.Generator().manual_seed(0)
        shape = (sizes["batch"], sizes["seq"])
        self.x = torch.randint(0, 256, shape, generator=generator).to(self.device)
        self.y = torch.randint(0, 256, shape, generator=generator).to(self.device)
        self.records: list[dict[str, Any]] = []
        self.stopped: str | None = None
        """Why the search must stop: memory left behind, or an error other than OOM."""
        self.baseline: int | None = None

    def _steps(self, depth: int) -> None:
        import torch

        import pipetrain
        from pipetrain.models import build_gpt, gpt_loss

        with torch.device(self.device):
            model = build_gpt(_config(self.sizes, depth), seed=0)
        net = pipetrain.GPipe(model, [len(model)], devices=[self.device],
                              chunks=self.sizes["chunks"], checkpoint=self.checkpoint)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
        for _ in range(2):
            gpt_loss(net(self.x), self.y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, depth: int) -> bool:
        import torch

        from pipetrain.bench.harness import PeakMemory

        began = time.monotonic()
        _clear_cublas_workspaces(self.device)
        allocated = free_device_memory(self.device)
        if self.baseline is None:
            self.baseline = allocated
        meter = PeakMemory([self.device])
        meter.start()
        record: dict[str, Any] = {"depth": depth, "allocated_before_mib": allocated / 2**20}
        try:
            self._steps(depth)
            peak = meter.peak_mib()
            record["peak_mib"] = peak
            if self.device.type == "cuda":
                fits = True
            else:
                fits = peak <= self.sizes["cap_mib"]
        except Exception as error:
            fits = False
            if is_out_of_memory(error):
                record["out_of_memory"] = error_text(error)[:200]
            else:
                record["error"] = error_text(error)
                self.stopped = f"the trial of depth {depth} failed: {error_text(error)}"
        _clear_cublas_workspaces(self.device)
        left = free_device_memory(self.device)
        if self.device.type == "cuda" and left > self.baseline + LEAK_BYTES:
            # what a trial leaves would shrink the next trials' room under the cap
            self.stopped = (f"{(left - self.baseline) / 2**20:.0f} MiB stayed allocated "
                            f"after the trial of depth {depth}")
            torch.cuda.empty_cache()
        record.update(fits=fits, seconds=round(time.monotonic() - began, 2))
        self.records.append(record)
        return fits


def _search(ctx: ItemContext, sizes: dict[str, Any], checkpoint: str,
            stop_at: float) -> dict[str, Any]:
    trial = _Trial(ctx, sizes, checkpoint)
    found = largest(trial, limit=sizes["limit"],
                    out_of_time=lambda: time.monotonic() > stop_at or trial.stopped is not None)
    depth = found["largest"]
    result = {"checkpoint": checkpoint, "largest_depth": depth,
              "parameters": parameters(sizes, depth) if depth else 0,
              "first_depth_too_large": found["first_too_large"],
              "complete": found["complete"], "reached_limit": found["reached_limit"],
              "trials": trial.records}
    if trial.stopped:
        result["stopped"] = trial.stopped
    elif not found["complete"]:
        result["stopped"] = "time budget"
    return result


def run(ctx: ItemContext) -> dict[str, Any]:
    import torch

    sizes = dict(ctx.pick(SIZES))
    device = ctx.torch_device()
    if ctx.cuda:
        sizes["cublas_workspaces_cleared_between_trials"] = hasattr(
            torch._C, "_cuda_clearCublasWorkspaces")
        total = torch.cuda.get_device_properties(device).total_memory
        cap = sizes["cap_gib"] * 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        sizes["cap"] = f"{sizes['cap_gib']} GiB (set_per_process_memory_fraction "\
                       f"{cap / total:.4f} of {total / 2**30:.1f} GiB)"
    else:
        sizes["cap"] = (f"{sizes['cap_mib']} MiB of measured peak (RSS growth); nothing "
                        "enforces it on the CPU")
    # first use of the code pages, allocator arenas, library handles
    _Trial(ctx, sizes, "never")(1)
    began = time.monotonic()
    results = {}
    # the half of the budget left for each search: the second one gets what the first left
    for k, (name, mode) in enumerate(MODES.items()):
        share = (ctx.left() - 3) / (len(MODES) - k)
        results[name] = _search(ctx, sizes, mode, time.monotonic() + share)
    without, with_ = (results["without_rematerialization"],
                      results["with_rematerialization"])
    ratio = (with_["parameters"] / without["parameters"]) if without["parameters"] else None
    complete = all(r["complete"] and not r.get("stopped") for r in results.values())
    row = {"width": sizes["width"], "without_rematerialization_depth": without["largest_depth"],
           "without_rematerialization_parameters": without["parameters"],
           "with_rematerialization_depth": with_["largest_depth"],
           "with_rematerialization_parameters": with_["parameters"],
           "parameter_ratio": ratio}
    status, reason = "ok", None
    if not complete:
        status = "failed"
        reason = "; ".join(f"{n}: search stopped ({r.get('stopped')})"
                           for n, r in results.items() if r.get("stopped"))
    elif without["largest_depth"] == 0:
        status, reason = "failed", "not even one block trains under the cap"
    return {"status": status, "reason": reason, "sizes": sizes, "table1_row": row,
            "search_seconds": round(time.monotonic() - began, 2), **results}
