"""Case ``transport``: pipetrain's point-to-point transport against raw c10d send / receive.

Two ranks (processes, gloo on 127.0.0.1, 1 intra-op thread each) bounce a float32
tensor of ``rows x 1024`` back and forth: rank 0 sends it on the activation channel,
rank 1 receives it and sends it back on the gradient channel. One *round trip* is timed
on rank 0; a batch of ``messages`` round trips makes one repetition, and the
repetitions go round-robin over the variants (interleaved, so that a busy period of a
shared machine hits all alike). Medians are reported, and each variant's ratio to the
anchor (above 1: slower than the anchor).

Variants:

- ``raw``: the anchor, what torch's pipelining does with static shapes: ``dist.isend``
  of the tensor, ``dist.irecv`` into a buffer of the known shape, both waited for (no
  metadata at all);
- ``inline``: ``DistTransport`` as the CPU pipeline runs it: the tensor rides in its
  header, the receive posted when the step begins (``expect``), taken by the main thread;
- ``inline+thread``: the same, the headers taken by a receive thread;
- ``apart``: ``inline_limit=0``: the tensor travels apart from its header, as device
  tensors do under NCCL (here over gloo);
- ``apart+thread``: the same with receive threads (NCCL's default).

Sizes above the transport's capacity (1 MiB) travel apart on every path. Full size:
8, 128 and 1024 rows, 15 repetitions of 50 round trips; ``--quick``: 4 repetitions of
20.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.drawings import bars, find_table
from pipetrain.bench.harness import median, run_job

__all__ = ["CASE", "VARIANTS", "WIDTH", "Sizes", "draw", "round_trip_job", "run"]

VARIANTS = ("raw", "inline", "inline+thread", "apart", "apart+thread")
WIDTH = 1024


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The tensors (rows of ``WIDTH`` floats) and repetitions of a run."""

    rows: tuple[int, ...]
    reps: int
    warmup: int
    messages: int


FULL = Sizes(rows=(8, 128, 1024), reps=15, warmup=2, messages=50)
QUICK = Sizes(rows=(8, 128, 1024), reps=4, warmup=1, messages=20)


def _raw_round_trip(rank: int, tensor: Any, buffer: Any) -> None:
    import torch.distributed as dist

    if rank == 0:
        send = dist.isend(tensor, dst=1)
        _wait(dist.irecv(buffer, src=1))
        _wait(send)
    else:
        _wait(dist.irecv(buffer, src=0))
        _wait(dist.isend(buffer, dst=0))


def _wait(work: Any) -> None:
    """Wait for a point-to-point request (``None`` only for ranks outside its group)."""
    assert work is not None, "both ranks are in the world group"
    work.wait()


def round_trip_job(ctx: Any, sizes: Sizes) -> dict[str, dict[str, float]]:
    """On each rank: every variant's median round trip (seconds) by tensor rows."""
    import torch
    import torch.distributed as dist

    from pipetrain.runtime.distributed import DistTransport
    from pipetrain.runtime.transport import ACTIVATION, GRADIENT, Channel, Placement

    forward, backward = Channel(ACTIVATION, 0, 1), Channel(GRADIENT, 1, 0)
    inbound, outbound = ([backward], [forward]) if ctx.rank == 0 else ([forward], [backward])
    options: dict[str, dict[str, Any]] = {
        "inline": {}, "inline+thread": {"receive_thread": True}, "apart": {"inline_limit": 0},
        "apart+thread": {"inline_limit": 0, "receive_thread": True}}
    transports = {name: DistTransport(placement=Placement.single([0, 1]), inbound=inbound,
                                      outbound=outbound, timeout=120, **kw)
                  for name, kw in options.items()}
    messages = sizes.messages

    def batch(variant: str, tensor: torch.Tensor, buffer: torch.Tensor) -> float:
        dist.barrier()
        start = time.perf_counter()
        if variant == "raw":
            for _ in range(messages):
                _raw_round_trip(ctx.rank, tensor, buffer)
        else:
            t = transports[variant]
            t.expect(inbound[0], list(range(messages)))
            for i in range(messages):
                if ctx.rank == 0:
                    t.send(forward, i, tensor)
                    t.recv(backward, i)
                else:
                    t.send(backward, i, t.recv(forward, i))
            t.flush()
        return (time.perf_counter() - start) / messages

    results: dict[str, dict[str, float]] = {}
    for n in sizes.rows:
        tensor, buffer = torch.randn(n, WIDTH), torch.empty(n, WIDTH)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(sizes.warmup + sizes.reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for variant in order:
                seconds = batch(variant, tensor, buffer)
                if rep >= sizes.warmup:
                    times[variant].append(seconds)
        results[str(n)] = {v: median(ts) for v, ts in times.items()}
    for t in transports.values():
        t.close()
    return results


def run(context: BenchContext) -> BenchResult:
    """Time the round trips of every variant and size in one 2-rank job."""
    sizes = QUICK if context.quick else FULL
    context.progress(f"2 ranks, rows {list(sizes.rows)}, {sizes.reps} repetitions of "
                     f"{sizes.messages} round trips")
    results: dict[str, dict[str, float]] = run_job(round_trip_job, sizes, timeout=1800)[0]
    rows = []
    for n, by_variant in results.items():
        kib = int(n) * WIDTH * 4 / 1024
        rows.append([f"{kib:.0f} KiB", *(round(by_variant[v] * 1e6, 1) for v in VARIANTS),
                     *(round(by_variant[v] / by_variant["raw"], 2) for v in VARIANTS[1:])])
    table = Table(
        title="Median round trip between 2 ranks (us), and each transport path's ratio to raw "
              "isend/irecv",
        columns=["message", *(f"{v} us" for v in VARIANTS),
                 *(f"{v} / raw" for v in VARIANTS[1:])],
        rows=rows,
        anchor="raw dist.isend / dist.irecv of the known shape (what torch.distributed."
               "pipelining does with static shapes), interleaved in the same job; gloo on "
               "127.0.0.1, 1 thread per rank",
        notes="inline: the tensor rides in its header (the CPU pipeline's path); apart: it "
              "travels after its header, as device tensors do under NCCL (here over gloo); "
              "+thread: headers taken by a receive thread. Messages above 1 MiB travel apart "
              "on every path. A ratio above 1 is slower than the anchor.",
        key="round_trip")
    return BenchResult(tables=[table], data={"sizes": asdict(sizes), "round_trip_s": results})


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Each transport path's round trip over raw isend/irecv's, per message size: one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['transport_round_trip.png']
    """
    return bars(out / "transport_round_trip.png", find_table(tables, "round_trip"), "message",
                {v: f"{v} / raw" for v in VARIANTS[1:]},
                title="Round trip between 2 ranks: each transport path over raw "
                      "isend/irecv (above 1: slower)", ylabel="ratio to raw", reference=1.0)


CASE = Case(name="transport", title="Point-to-point transport vs raw isend/irecv",
            run=run, draw=draw, quick_seconds=8, full_seconds=70)
