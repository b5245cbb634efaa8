"""Item ``gpipe_streams``: do GPipe's copies and compute of different micro-batches
overlap on the GPU?

Two layouts of one MLP (narrow enough that one kernel does not fill the GPU), each
traced for two training steps with ``torch.profiler`` (CUDA activity; the traces are
written as ``gpipe_streams.<layout>.trace.json.gz``):

- ``one_gpu``: two partitions on ``cuda:0``, each computing on its own stream: kernels
  of the two partitions' streams running at the same time are compute of different
  micro-batches (partition 1 works on micro-batch ``i`` only after partition 0 has
  finished it, so whatever partition 0 runs meanwhile is a later one);
- ``cpu_then_gpu``: partition 0 on the CPU, partition 1 on ``cuda:0``: each
  micro-batch's activations are copied host to device on a copy stream, and a copy
  running while the GPU computes on another stream is the copy of one micro-batch
  beside the compute of another (the compute of micro-batch ``i`` waits for its copy).

From the trace's GPU events (kernels, copies, memsets; each with its stream) the item
reports per stream the busy time, the time during which two or more streams were busy,
and the time copies overlapped kernels of other streams, and states plainly whether
they overlapped; where they did not, it names the likely cause from the figures. Not
applicable on the CPU (no streams).
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

from gpu.common import ItemContext, case_status, run_case, synchronize

__all__ = ["gpu_events", "overlap_report", "run"]

SIZES = {"width": 1024, "depth": 8, "batch": 512, "chunks": 8, "warmup": 3}
MIN_OVERLAP = 0.01
"""Overlap below this share of the smaller busy time counts as none."""

Interval = tuple[float, float]


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU events of a Chrome trace from ``torch.profiler``: ``kind`` (kernel,
    memcpy, memset), ``stream``, ``start`` and ``end`` (microseconds), ``name``.

    Example:
        >>> gpu_events({"traceEvents": [
        ...     {"cat": "kernel", "name": "k", "ts": 1, "dur": 2, "args": {"stream": 7}},
        ...     {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9}]})
        [{'kind': 'kernel', 'name': 'k', 'stream': 7, 'start': 1.0, 'end': 3.0}]
    """
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    events = []
    for event in trace.get("traceEvents", []):
        kind = kinds.get(str(event.get("cat", "")).lower())
        if kind is None or "dur" not in event:
            continue
        start = float(event["ts"])
        events.append({"kind": kind, "name": str(event.get("name", ""))[:80],
                       "stream": int(event.get("args", {}).get("stream", -1)),
                       "start": start, "end": start + float(event["dur"])})
    return events


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted((float(a), float(b)) for a, b in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_report(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Busy time per stream, time with two or more streams busy, copies beside kernels
    of other streams (microseconds), from :func:`gpu_events`' events.

    Example:
        >>> events = [{"kind": "kernel", "stream": 1, "start": 0, "end": 10},
        ...           {"kind": "kernel", "stream": 2, "start": 5, "end": 12},
        ...           {"kind": "memcpy", "stream": 3, "start": 8, "end": 20}]
        >>> report = overlap_report(events)
        >>> report["concurrent_us"], report["copy_beside_compute_us"], report["gpu_busy_us"]
        (7.0, 4.0, 20.0)
    """
    streams = sorted({e["stream"] for e in events})
    busy = {s: _union((e["start"], e["end"]) for e in events if e["stream"] == s)
            for s in streams}
    # time with at least two streams busy: sweep over the streams' busy intervals
    points = sorted([(a, 1) for s in streams for a, _ in busy[s]]
                    + [(b, -1) for s in streams for _, b in busy[s]], key=lambda p: (p[0], p[1]))
    concurrent, active, last = 0.0, 0, None
    for time_us, delta in points:
        if last is not None and active >= 2:
            concurrent += time_us - last
        active += delta
        last = time_us
    copy_beside = 0.0
    for s in streams:
        copies = _union((e["start"], e["end"]) for e in events
                        if e["stream"] == s and e["kind"] == "memcpy")
        if not copies:
            continue
        others = _union((e["start"], e["end"]) for e in events
                        if e["stream"] != s and e["kind"] == "kernel")
        copy_beside += _length(_intersection(copies, others))
    every = _union((e["start"], e["end"]) for e in events)
    span = (every[-1][1] - every[0][0]) if every else 0.0
    kernels = [e for e in events if e["kind"] == "kernel"]
    return {
        "streams": {str(s): {"busy_us": _length(busy[s]),
                             "kernels": sum(e["stream"] == s and e["kind"] == "kernel"
                                            for e in events),
                             "copies": sum(e["stream"] == s and e["kind"] == "memcpy"
                                           for e in events)} for s in streams},
        "span_us": span, "gpu_busy_us": _length(every),
        "gpu_idle_share": (1 - _length(every) / span) if span else None,
        "concurrent_us": concurrent, "copy_beside_compute_us": copy_beside,
        "mean_kernel_us": (sum(e["end"] - e["start"] for e in kernels) / len(kernels)
                           if kernels else None),
    }


def _statement(layout: str, report: dict[str, Any]) -> tuple[bool, str]:
    busy = sorted((s["busy_us"] for s in report["streams"].values()), reverse=True)
    smaller = busy[1] if len(busy) > 1 else 0.0
    if layout == "cpu_then_gpu":
        amount, what = report["copy_beside_compute_us"], "host-to-device copies ran beside kernels"
        base = sum(s["busy_us"] for s in report["streams"].values() if s["copies"]) or smaller
    else:
        amount, what = report["concurrent_us"], "kernels of two or more streams ran together"
        base = smaller
    if base and amount >= MIN_OVERLAP * base:
        return True, (f"overlap: {what} for {amount / 1e3:.2f} ms "
                      f"({100 * amount / base:.0f}% of the smaller stream's busy time)")
    idle = report.get("gpu_idle_share") or 0.0
    if len(busy) < 2:
        cause = "all GPU work ran on one stream"
    elif idle > 0.5:
        cause = (f"the GPU was idle {100 * idle:.0f}% of the traced time: the host threads "
                 "did not queue work for two streams at once (launch-bound)")
    else:
        cause = ("the GPU was busy most of the time with kernels that each fill it "
                 f"(mean kernel {report.get('mean_kernel_us') or 0:.0f} us): the streams "
                 "took turns")
    return False, f"no overlap: {what} for {amount / 1e3:.3f} ms only; likely cause: {cause}"


def _trace_layout(ctx: ItemContext, layout: str) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    import pipetrain

    torch.manual_seed(0)
    width, depth = SIZES["width"], SIZES["depth"]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(depth)])
    gpu = torch.device("cuda", 0)
    if layout == "one_gpu":
        balance, devices = [depth // 2, depth - depth // 2], [gpu, gpu]
    else:
        balance, devices = [1, depth - 1], [torch.device("cpu"), gpu]
    pipe = pipetrain.GPipe(model, balance, devices=devices, chunks=SIZES["chunks"],
                           checkpoint="except_last")
    batch = torch.randn(SIZES["batch"], width, device=devices[0])

    def step() -> None:
        pipe(batch).float().pow(2).mean().backward()
        pipe.zero_grad(set_to_none=True)
        synchronize(gpu)

    for _ in range(SIZES["warmup"]):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
    raw = os.path.join(ctx.out_dir, f"gpipe_streams.{layout}.trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    with open(raw, "rb") as source, gzip.open(raw + ".gz", "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(raw)
    events = gpu_events(trace)
    if not events:
        return {"status": "failed", "reason": "the profiler recorded no GPU event (CUPTI?)",
                "trace": os.path.basename(raw) + ".gz"}
    report = overlap_report(events)
    overlapped, statement = _statement(layout, report)
    return {"layout": layout, "balance": balance, "devices": [str(d) for d in devices],
            "overlap": overlapped, "statement": statement, "events": len(events),
            "trace": os.path.basename(raw) + ".gz", **report}


def run(ctx: ItemContext) -> dict[str, Any]:
    if not ctx.cuda:
        return {"status": "skipped", "reason": "not applicable on the CPU: GPipe's streams "
                "and copy streams exist only for partitions on a GPU"}
    cases: list[dict[str, Any]] = []
    for layout in ("one_gpu", "cpu_then_gpu"):
        run_case(cases, layout, functools.partial(_trace_layout, ctx, layout), ctx, needs_s=5)
    status, reason = case_status(cases)
    statements = {c["case"]: c.get("statement", c.get("reason")) for c in cases}
    return {"status": status, "reason": reason, "sizes": SIZES, "statements": statements,
            "cases": cases}
