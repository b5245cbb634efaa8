"""Benchmark: pipetrain.GPipe against torchgpipe.GPipe and plain nn.Sequential.

Measures the wall time of a training step (forward, ``loss.backward()``, ``zero_grad``)
of the SAME model (identical initial weights) on the SAME batch, three ways:

- ``pipetrain``: ``pipetrain.GPipe(model, balance, chunks=..., checkpoint=...)``; every
  partition runs on its own persistent worker thread, also when partitions share the CPU;
- ``torchgpipe``: ``torchgpipe.GPipe`` 0.0.7 with the same balance, chunks and checkpoint
  mode, ``devices=['cpu'] * len(balance)`` (it runs the partitions of one device on one
  thread);
- ``plain``: the ``nn.Sequential`` itself (no micro-batches, no recomputation).

Each of the three runs in its own process, as its users would run it: pipetrain's stage
workers change process-wide state (they make GNU OpenMP count them, which shortens how
long its idle threads spin, see ``pipetrain.runtime.workers``), and that would slow the
other two down if they shared the process. The parent checks that the three compute the
same output and interleaves their timing.

The default model is ``depth`` x [Linear(width, width) + ReLU] (each pair one child),
batch 256, balance [4, 4], 4 chunks, checkpoint ``except_last``. After a warm-up, the
timed steps are interleaved round-robin across the three (the starting one rotates)
in blocks of ``--block`` consecutive steps, each block after one untimed step, so that
a slow period of a shared machine hits all three alike while each is timed as in its
own training loop. (Timing single steps in turn would not: after a parallel region,
torch's OpenMP threads keep spinning for milliseconds under GNU OpenMP's default wait
policy, so every step would start with the previous implementation's threads burning
a core; and a pause in between lets the CPUs idle, which costs a thread hand-off a
wake-up.) Medians are reported, with throughput (samples/s) and the ratios
pipetrain / torchgpipe and pipetrain / plain (of throughput: above 1 means pipetrain
is faster).

Run (from the repository root):

    python benchmarks/gpipe_local.py                       # the default setting
    python benchmarks/gpipe_local.py --repetitions 30 --json
    python benchmarks/gpipe_local.py --width 1024 --depth 16 --balance 8,8 --chunks 8

CPU timings depend on the machine and on what else runs on it; compare ratios from one
run, not absolute figures across machines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
from torch import nn

NAMES = ("pipetrain", "torchgpipe", "plain")


def build_model(width: int, depth: int, seed: int) -> nn.Sequential:
    """``depth`` children, each Linear(width, width) + ReLU."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(depth)])


def make_step(model: nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        output = model(batch)
        output.pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512, help="features of each linear layer")
    parser.add_argument("--depth", type=int, default=8, help="number of Linear+ReLU children")
    parser.add_argument("--batch", type=int, default=256, help="mini-batch size")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--balance", default="4,4",
                        help="children per partition, comma separated (default 4,4)")
    parser.add_argument("--checkpoint", default="except_last",
                        choices=["always", "except_last", "never"])
    parser.add_argument("--repetitions", type=int, default=30,
                        help="timed steps of each of the three")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each first")
    parser.add_argument("--block", type=int, default=5,
                        help="consecutive timed steps of one implementation per turn")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--recompute-ahead", type=int, default=None,
                        help="pipetrain.GPipe's recompute_ahead (default: its default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    try:
        args.balance = [int(b) for b in args.balance.split(",")]
    except ValueError:
        parser.error(f"--balance must be comma-separated integers, got {args.balance!r}; "
                     "e.g. --balance 4,4")
    if sum(args.balance) != args.depth:
        parser.error(f"--balance {args.balance} sums to {sum(args.balance)} but --depth is "
                     f"{args.depth}; e.g. --balance {args.depth // 2},{args.depth - args.depth // 2}")
    return args


def build(name: str, args: argparse.Namespace) -> nn.Module:
    """The model ``name`` times: the same weights for all three."""
    base = build_model(args.width, args.depth, args.seed)
    devices = ["cpu"] * len(args.balance)
    if name == "pipetrain":
        import pipetrain

        options = {} if args.recompute_ahead is None else {"recompute_ahead": args.recompute_ahead}
        return pipetrain.GPipe(base, args.balance, devices=devices, chunks=args.chunks,
                               checkpoint=args.checkpoint, **options)
    if name == "torchgpipe":
        import torchgpipe

        return torchgpipe.GPipe(base, args.balance, devices=devices, chunks=args.chunks,
                                checkpoint=args.checkpoint)
    return base


def child(name: str, args: argparse.Namespace, conn: Connection) -> None:
    """One implementation in its own process: report its output, then time steps on demand."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = build(name, args)
    torch.manual_seed(args.seed + 1)
    batch = torch.randn(args.batch, args.width)
    seen: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
             for layer in model.modules() if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        output = model(batch)
    for hook in hooks:
        hook.remove()
    conn.send((output, sorted(set(seen)), torch.get_num_threads()))
    step = make_step(model, batch)
    while True:
        request = conn.recv()
        if request is None:
            return
        untimed, timed = request
        for _ in range(untimed):
            step()
        times = []
        for _ in range(timed):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        conn.send(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torchgpipe
    except ImportError:
        print("torchgpipe is not installed; fix: pip install torchgpipe==0.0.7", file=sys.stderr)
        return 2
    context = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    processes = []
    for name in NAMES:
        parent_end, child_end = context.Pipe()
        process = context.Process(target=child, args=(name, args, child_end), daemon=True)
        process.start()
        conns[name] = parent_end
        processes.append(process)
    try:
        return _coordinate(args, conns, torchgpipe.__version__)
    finally:
        for conn in conns.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def _coordinate(args: argparse.Namespace, conns: dict[str, Connection],
                torchgpipe_version: str) -> int:
    # the three compute the same function of the same weights; record the intra-op
    # thread counts their layers run with
    threads_seen: dict[str, list[int]] = {}
    torch_threads = 0
    outputs = {}
    for name in NAMES:
        outputs[name], threads_seen[name], torch_threads = conns[name].recv()
    reference = outputs["plain"]
    for name in NAMES:
        diff = (outputs[name] - reference).abs().max().item()
        if diff > 1e-4 * max(1.0, reference.abs().max().item()):
            print(f"{name} output differs from plain by {diff:.3g}", file=sys.stderr)
            return 1

    for name in NAMES:
        conns[name].send((args.warmup, 0))
        conns[name].recv()
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    num_rounds = -(-args.repetitions // args.block)
    for r in range(num_rounds):
        for k in range(len(NAMES)):
            name = NAMES[(r + k) % len(NAMES)]
            # one untimed step first: the previous implementation's threads settle
            conns[name].send((1, min(args.block, args.repetitions - r * args.block)))
            times[name].extend(conns[name].recv())

    medians = {name: statistics.median(times[name]) for name in NAMES}
    quartiles = {name: statistics.quantiles(times[name], n=4) if len(times[name]) > 1
                 else [times[name][0]] * 3 for name in NAMES}
    throughput = {name: args.batch / medians[name] for name in NAMES}
    result = {
        "setting": {
            "model": f"{args.depth} x [Linear({args.width}, {args.width}) + ReLU]",
            "width": args.width, "depth": args.depth, "batch": args.batch,
            "chunks": args.chunks, "balance": args.balance, "checkpoint": args.checkpoint,
            "repetitions": args.repetitions, "warmup": args.warmup,
            "block": args.block,
            "torch_threads": torch_threads, "cpus": os.cpu_count(),
            "processes": "one per implementation",
            "intra_op_threads_in_layers": threads_seen,
            "torch": torch.__version__, "torchgpipe": torchgpipe_version,
            "python": platform.python_version(),
        },
        "median_step_ms": {name: medians[name] * 1e3 for name in NAMES},
        "quartiles_step_ms": {name: [q * 1e3 for q in quartiles[name]] for name in NAMES},
        "throughput_samples_per_s": throughput,
        "ratio_pipetrain_over_torchgpipe": throughput["pipetrain"] / throughput["torchgpipe"],
        "ratio_pipetrain_over_plain": throughput["pipetrain"] / throughput["plain"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    setting = result["setting"]
    print(f"{setting['model']}, batch {args.batch}, balance {args.balance}, chunks "
          f"{args.chunks}, checkpoint {args.checkpoint}; {args.repetitions} repetitions "
          f"after {args.warmup} warm-up, in blocks of {args.block}, "
          f"{setting['torch_threads']} torch threads, "
          f"{setting['cpus']} CPUs; intra-op threads in the layers: {threads_seen}")
    print(f"{'':<12}{'median ms':>12}{'IQR ms':>18}{'samples/s':>12}")
    for name in NAMES:
        q1, _, q3 = result["quartiles_step_ms"][name]
        print(f"{name:<12}{medians[name] * 1e3:>12.2f}{f'{q1:.2f}-{q3:.2f}':>18}"
              f"{throughput[name]:>12.0f}")
    print(f"pipetrain / torchgpipe throughput: {result['ratio_pipetrain_over_torchgpipe']:.2f}x")
    print(f"pipetrain / plain throughput:      {result['ratio_pipetrain_over_plain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
