"""Benchmark: pipetrain's point-to-point transport against raw c10d send / receive.

Two ranks (processes, gloo on 127.0.0.1, 1 intra-op thread each) bounce a float32
tensor of ``rows x 1024`` back and forth: rank 0 sends it on the activation channel,
rank 1 receives it and sends it back on the gradient channel. One *round trip* is timed
on rank 0; a batch of ``--messages`` round trips makes one repetition, and the
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

Sizes above the transport's capacity (1 MiB) travel apart on every path.

Run (from the repository root)::

    PYTHONPATH=src python benchmarks/transport.py
    PYTHONPATH=src python benchmarks/transport.py --rows 8,128,1024 --reps 15 --json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pipetrain.bench.harness import dump_json, median, run_job

VARIANTS = ("raw", "inline", "inline+thread", "apart", "apart+thread")
WIDTH = 1024


def _raw_round_trip(rank: int, tensor: Any, buffer: Any) -> None:
    import torch.distributed as dist

    if rank == 0:
        send = dist.isend(tensor, dst=1)
        dist.irecv(buffer, src=1).wait()
        send.wait()
    else:
        dist.irecv(buffer, src=0).wait()
        dist.isend(buffer, dst=0).wait()


def _job(ctx: Any, rows: list[int], reps: int, messages: int, warmup: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    from pipetrain.runtime.distributed import DistTransport
    from pipetrain.runtime.transport import ACTIVATION, GRADIENT, Channel, Placement

    forward, backward = Channel(ACTIVATION, 0, 1), Channel(GRADIENT, 1, 0)
    inbound, outbound = ([backward], [forward]) if ctx.rank == 0 else ([forward], [backward])
    options = {"inline": {}, "inline+thread": {"receive_thread": True}, "apart": {"inline_limit": 0},
               "apart+thread": {"inline_limit": 0, "receive_thread": True}}
    transports = {name: DistTransport(placement=Placement.single([0, 1]), inbound=inbound,
                                      outbound=outbound, timeout=120, **kw)
                  for name, kw in options.items()}

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
    for n in rows:
        tensor, buffer = torch.randn(n, WIDTH), torch.empty(n, WIDTH)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(warmup + reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for variant in order:
                seconds = batch(variant, tensor, buffer)
                if rep >= warmup:
                    times[variant].append(seconds)
        results[str(n)] = {v: median(ts) for v, ts in times.items()}
    for t in transports.values():
        t.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8,128,1024", help="rows of the 1024-wide tensor, comma-separated")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--messages", type=int, default=50, help="round trips per repetition")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    outcome = run_job(_job, rows, args.reps, args.messages, args.warmup, timeout=1800)
    results = outcome[0]
    if args.json:
        sys.stdout.write(dump_json({"round_trip_s": results, "config": vars(args)}) + "\n")
        return 0
    sys.stdout.write("median round trip (ratio to raw isend/irecv of the known shape)\n")
    for n, by_variant in results.items():
        size = int(n) * WIDTH * 4
        cells = "  ".join(f"{v}: {s * 1e6:8.1f} us ({s / by_variant['raw']:.2f}x)" for v, s in by_variant.items())
        sys.stdout.write(f"{size / 1024:8.0f} KiB  {cells}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
