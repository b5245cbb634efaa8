"""Item ``gpipe_vs_torchgpipe``: ``pipetrain.GPipe`` vs ``torchgpipe.GPipe`` 0.0.7 on one
device.

Both cut the same model (same initial weights) into the same two partitions, both on
the one device (``cuda:0``, or the CPU), with the same micro-batches and checkpoint
mode, and train on the same batch (forward, ``loss.backward()``, ``zero_grad``; the
loss is the mean square of the output, as in ``pipetrain bench gpipe_vs_torchgpipe``, whose
model builder and step this item uses). Models: pipetrain's GPT (untied embeddings)
and its ResNet (GroupNorm, so micro-batching changes no output); precisions: fp32 and
bf16 autocast (pipetrain: ``GPipe(mixed_precision="bf16")``; torchgpipe, which has no
such option and runs partitions on its own threads, where an outer ``torch.autocast``
does not reach: every layer wrapped in ``torch.autocast``); every checkpoint mode.

Per case: the two outputs agree (a sanity check: else the timing means nothing), the
peak memory of one step (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, above the memory allocated before the step, through
``pipetrain.bench.harness.memory``; not measured on the CPU, where both share one process:
``pipetrain bench gpipe_vs_torchgpipe`` measures CPU memory, one process each), and the median
step time of interleaved repetitions; ratios pipetrain / torchgpipe (throughput above
1: pipetrain is faster; memory below 1: pipetrain needs less).
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpu.common import (
    ItemContext,
    case_status,
    error_text,
    free_device_memory,
    interleaved_times,
    run_case,
    synchronize,
)

__all__ = ["SIZES", "Autocast", "load_torchgpipe", "run"]

SIZES: dict[str, dict[str, Any]] = {
    "cuda": {"gpt": {"depth": 8, "width": 1024, "heads": 16, "seq": 256, "batch": 32},
             "resnet": {"widths": (64, 128, 256), "blocks": 2, "image": 32, "batch": 256},
             "chunks": 8, "warmup": 3, "rounds": 4, "block": 3},
    "cpu": {"gpt": {"depth": 4, "width": 128, "heads": 4, "seq": 64, "batch": 16},
            "resnet": {"widths": (16, 32), "blocks": 2, "image": 16, "batch": 32},
            "chunks": 4, "warmup": 2, "rounds": 3, "block": 3},
    "quick": {"gpt": {"depth": 2, "width": 32, "heads": 2, "seq": 16, "batch": 8},
              "resnet": {"widths": (4, 8), "blocks": 1, "image": 8, "batch": 8},
              "chunks": 4, "warmup": 1, "rounds": 2, "block": 2},
}
MODELS = ("gpt", "resnet")
PRECISIONS = ("bf16", "fp32")
MODES = ("always", "except_last", "never")
TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}
"""Largest difference of the two outputs, relative to the largest output (at least 1)."""


class Autocast(nn.Module):
    """Runs ``layer`` under ``torch.autocast`` (the torchgpipe side of bf16: its
    partitions run on its own worker threads, which an outer autocast does not reach).

    Example:
        >>> layer = Autocast(nn.Linear(2, 2), "cpu", torch.bfloat16)
        >>> layer(torch.ones(1, 2)).dtype
        torch.bfloat16
    """

    def __init__(self, layer: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *inputs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.layer(*inputs)


def load_torchgpipe() -> tuple[Any, dict[str, Any]]:
    """``torchgpipe`` and where it came from, or ``None`` and why."""
    try:
        import torchgpipe
    except ImportError as error:
        return None, {"error": error_text(error),
                      "fix": "run `bash benchmarks/gpu/prepare.sh` where torchgpipe 0.0.7 is "
                             "installed and carry benchmarks/gpu/.deps to the GPU machine"}
    return torchgpipe, {"version": torchgpipe.__version__, "path": torchgpipe.__file__,
                        "shims": []}


def _record_stream_shim(torchgpipe: Any) -> None:
    """torchgpipe's ``record_stream`` works around a PyTorch 1.1 bug with views by
    re-wrapping the tensor's ``storage()`` (a deprecated typed storage); current
    PyTorch records views directly."""
    from torchgpipe import copy as tg_copy
    from torchgpipe import stream as tg_stream

    def record_stream(tensor: Any, stream: Any) -> None:
        if tg_stream.is_cuda(stream):
            tensor.record_stream(tg_stream.as_cuda(stream))

    tg_stream.record_stream = record_stream
    tg_copy.record_stream = record_stream


def _probe(torchgpipe: Any, device: Any, info: dict[str, Any]) -> None:
    """A tiny torchgpipe step on ``device``; on a CUDA failure, apply the known shim
    and try again (``info["shims"]`` says what was applied and why)."""

    def tiny() -> None:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        pipe = torchgpipe.GPipe(model, [2, 1], devices=[device, device], chunks=2,
                                checkpoint="always")
        pipe(torch.randn(4, 8, device=device)).sum().backward()
        synchronize(device)

    try:
        tiny()
    except Exception as error:
        if device.type != "cuda":
            raise
        _record_stream_shim(torchgpipe)
        info["shims"].append({"shim": "record_stream without storage()",
                              "because": error_text(error)})
        tiny()


def _build(model: str, sizes: dict[str, Any]) -> tuple[Any, Callable[[Any], Any]]:
    """The model (seeded) and a function making its batch on a device."""
    if model == "gpt":
        from pipetrain.bench.gpipe_runs import build_model, make_batch

        args = argparse.Namespace(model="gpt", seed=0, activation="relu", **sizes["gpt"])
        return build_model(args), lambda device: make_batch(args, device)
    from pipetrain.models import ResNetConfig, build_resnet

    r = sizes["resnet"]
    net = build_resnet(ResNetConfig(widths=tuple(r["widths"]), num_blocks=r["blocks"],
                                    norm="group"), seed=0)

    def batch(device: Any) -> Any:
        generator = torch.Generator().manual_seed(1)
        return torch.randn(r["batch"], 3, r["image"], r["image"], generator=generator).to(device)

    return net, batch


def _case(ctx: ItemContext, torchgpipe: Any, model: str, precision: str,
          mode: str) -> dict[str, Any]:
    import pipetrain
    from pipetrain.bench.gpipe_runs import make_step
    from pipetrain.bench.harness import PeakMemory

    sizes = ctx.pick(SIZES)
    device = ctx.torch_device()
    base, make_batch = _build(model, sizes)
    half = len(base) // 2
    balance = [half, len(base) - half]
    devices = [device, device]
    ours = pipetrain.GPipe(copy.deepcopy(base), balance, devices=devices, chunks=sizes["chunks"],
                           checkpoint=mode, mixed_precision=None if precision == "fp32" else "bf16")
    layers = copy.deepcopy(base)
    if precision == "bf16":
        layers = nn.Sequential(*[Autocast(layer, device.type, torch.bfloat16)
                                       for layer in layers])
    theirs = torchgpipe.GPipe(layers, balance, devices=devices, chunks=sizes["chunks"],
                              checkpoint=mode)
    batch = make_batch(device)
    with torch.no_grad():
        mine, other = ours(batch).float(), theirs(batch).float()
    scale = max(1.0, other.abs().max().item())
    difference = (mine - other).abs().max().item() / scale
    result: dict[str, Any] = {
        "model": model, "precision": precision, "checkpoint": mode, "balance": balance,
        "chunks": sizes["chunks"], "batch": int(batch.shape[0]),
        "parameters": sum(p.numel() for p in base.parameters()),
        "outputs_relative_difference": difference, "tolerance": TOLERANCE[precision],
    }
    if not difference <= TOLERANCE[precision]:
        result.update(status="failed", reason=f"the outputs differ by {difference:.3g} of their "
                      f"largest value (tolerance {TOLERANCE[precision]}): timing skipped")
        return result
    steps = {"pipetrain": make_step(ours, batch, device),
             "torchgpipe": make_step(theirs, batch, device)}
    for step in steps.values():
        step()  # the first step builds streams, workers, optimizer-free gradients
    if ctx.cuda:
        peaks = {}
        for name, step in steps.items():
            meter = PeakMemory([device])
            meter.start()
            step()
            peaks[name] = meter.peak_mib()
        result["peak_mib"] = peaks
        result["peak_memory_pipetrain_over_torchgpipe"] = peaks["pipetrain"] / peaks["torchgpipe"]
    else:
        result["peak_mib"] = None
        result["peak_memory_note"] = ("not measured on the CPU (both in one process); see "
                                      "pipetrain bench gpipe_vs_torchgpipe")
    times = interleaved_times(steps, warmup=sizes["warmup"], rounds=sizes["rounds"],
                              block=sizes["block"])
    from pipetrain.bench.harness import summary

    stats = {name: summary(values) for name, values in times.items()}
    result["step_s"] = stats
    result["throughput_samples_per_s"] = {name: result["batch"] / s["median_s"]
                                          for name, s in stats.items()}
    result["throughput_pipetrain_over_torchgpipe"] = (stats["torchgpipe"]["median_s"]
                                                      / stats["pipetrain"]["median_s"])
    del ours, theirs, steps
    free_device_memory(device)
    return result


def run(ctx: ItemContext) -> dict[str, Any]:
    torchgpipe, info = load_torchgpipe()
    if torchgpipe is None:
        return {"status": "failed", "reason": f"torchgpipe cannot be imported: {info['error']}",
                "torchgpipe": info}
    try:
        _probe(torchgpipe, ctx.torch_device(), info)
    except Exception as error:
        return {"status": "failed", "torchgpipe": info,
                "reason": f"torchgpipe {info['version']} cannot run a step on {ctx.device} "
                          f"with torch {torch.__version__}: {error_text(error)}"}
    cases: list[dict[str, Any]] = []
    longest = 0.0
    for model in MODELS:
        for precision in PRECISIONS:
            for mode in MODES:
                began = time.monotonic()
                run_case(cases, f"{model}-{precision}-{mode}",
                         functools.partial(_case, ctx, torchgpipe, model, precision, mode),
                         ctx, needs_s=1.2 * longest)
                longest = max(longest, time.monotonic() - began)
    status, reason = case_status(cases)
    ratios = {c["case"]: round(c["throughput_pipetrain_over_torchgpipe"], 3)
              for c in cases if "throughput_pipetrain_over_torchgpipe" in c}
    memory = {c["case"]: round(c["peak_memory_pipetrain_over_torchgpipe"], 3)
              for c in cases if "peak_memory_pipetrain_over_torchgpipe" in c}
    return {"status": status, "reason": reason, "torchgpipe": info,
            "sizes": ctx.pick(SIZES), "throughput_ratios": ratios,
            "peak_memory_ratios": memory or None, "cases": cases}
