"""Benchmark: pipetrain.GPipe against torchgpipe.GPipe and plain nn.Sequential.

Measures the wall time and the peak memory of a training step (forward,
``loss.backward()``, ``zero_grad``) of the SAME model (identical initial weights) on the
SAME batch, three ways:

- ``pipetrain``: ``pipetrain.GPipe(model, balance, chunks=..., checkpoint=...)`` with its
  default options (unless flags below ask for opt-in ones); every partition runs on its
  own persistent worker thread, also when partitions share the CPU;
- ``torchgpipe``: ``torchgpipe.GPipe`` 0.0.7 with the same balance, chunks and checkpoint
  mode and devices (it runs the partitions of one device on one thread);
- ``plain``: the ``nn.Sequential`` itself (no micro-batches, no recomputation).

Each of the three runs in its own process, as its users would run it (with
``--throttle-openmp-spin``, pipetrain's stage workers change process-wide OpenMP state,
see ``pipetrain.runtime.workers``; and memory is only comparable between processes).

Models (``--model``): ``mlp``, ``depth`` x [Linear(width, width) + activation] (each
pair one child); ``gpt``, pipetrain's GPT (``pipetrain.models.gpt``: embedding,
``depth`` pre-LayerNorm transformer blocks, head; ``width`` channels, ``--heads``,
``--seq`` tokens, no dropout, untied embeddings) whose balance covers ``depth + 2``
layers. The loss is the mean square of the output (logits for the GPT).

Memory: each process measures the peak over its FIRST step (RSS growth on the CPU, from
right after building the model; the CUDA allocator's peak on a GPU; see
``peak_memory.py``), and the peak over the whole run (first step, warm-up and timed
steps: what training with it needs). ``--memory-only`` skips the timing.

Timing: after a warm-up, the timed steps are interleaved round-robin across the three
(the starting one rotates) in blocks of ``--block`` consecutive steps, each block after
one untimed step, so that a slow period of a shared machine hits all three alike while
each is timed as in its own training loop. Medians are reported, with throughput
(samples/s) and the ratios pipetrain / torchgpipe and pipetrain / plain (of throughput:
above 1 means pipetrain is faster).

Run (from the repository root):

    python benchmarks/gpipe_local.py                       # the default setting
    python benchmarks/gpipe_local.py --repetitions 30 --json
    python benchmarks/gpipe_local.py --width 1024 --depth 16 --activation gelu \\
        --batch 2048 --balance 8,8 --chunks 8 --checkpoint all --memory-only
    python benchmarks/gpipe_local.py --model gpt --depth 8 --width 256 --seq 128 \\
        --batch 32 --balance 5,5 --chunks 8 --checkpoint all --memory-only
    python benchmarks/gpipe_local.py --device cuda          # partitions on cuda:0, cuda:1...

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
from typing import Any

import torch
from torch import nn

from pipetrain.bench.harness import PeakMemory
from pipetrain.bench.harness import memory_available as available

NAMES = ("pipetrain", "torchgpipe", "plain")
MODES = ("never", "except_last", "always")


def build_model(args: argparse.Namespace) -> nn.Sequential:
    """The benchmark's model, seeded: the same weights in every process."""
    torch.manual_seed(args.seed)
    if args.model == "gpt":
        from pipetrain.models.gpt import GPTConfig, build_gpt

        config = GPTConfig(num_layers=args.depth, width=args.width, num_heads=args.heads,
                           context=args.seq, tie_embeddings=False)
        return build_gpt(config, seed=args.seed)
    activation = nn.GELU if args.activation == "gelu" else nn.ReLU
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), activation())
                           for _ in range(args.depth)])


def make_batch(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    torch.manual_seed(args.seed + 1)
    if args.model == "gpt":
        return torch.randint(0, 256, (args.batch, args.seq), device=device)
    return torch.randn(args.batch, args.width, device=device)


def make_step(model: nn.Module, batch: torch.Tensor, device: torch.device) -> Callable[[], None]:
    def step() -> None:
        output = model(batch)
        output.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    parser.add_argument("--width", type=int, default=512, help="features / channels")
    parser.add_argument("--depth", type=int, default=8,
                        help="Linear+activation children (mlp) or transformer blocks (gpt)")
    parser.add_argument("--activation", default="relu", choices=["relu", "gelu"],
                        help="the mlp's activation")
    parser.add_argument("--heads", type=int, default=4, help="the gpt's attention heads")
    parser.add_argument("--seq", type=int, default=128, help="the gpt's tokens per sample")
    parser.add_argument("--batch", type=int, default=256, help="mini-batch size")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--balance", default=None,
                        help="layers per partition, comma separated (default: two halves)")
    parser.add_argument("--checkpoint", default="except_last", choices=[*MODES, "all"],
                        help="checkpoint mode; 'all' runs the three modes one after another")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: partition j on cuda:(j mod the number of GPUs)")
    parser.add_argument("--repetitions", type=int, default=30,
                        help="timed steps of each of the three")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each first")
    parser.add_argument("--block", type=int, default=5,
                        help="consecutive timed steps of one implementation per turn")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the first step's peak memory (no timing)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--recompute-ahead", type=int, default=None,
                        help="pipetrain.GPipe's recompute_ahead (default: its default)")
    parser.add_argument("--reuse-gradient-buffers", action="store_true",
                        help="pipetrain.GPipe(reuse_gradient_buffers=True) (opt-in)")
    parser.add_argument("--throttle-openmp-spin", action="store_true",
                        help="pipetrain.GPipe(throttle_openmp_spin=True) (opt-in)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    num_layers = args.depth + 2 if args.model == "gpt" else args.depth
    if args.balance is None:
        args.balance = [num_layers // 2, num_layers - num_layers // 2]
    else:
        try:
            args.balance = [int(b) for b in args.balance.split(",")]
        except ValueError:
            parser.error(f"--balance must be comma-separated integers, got {args.balance!r}; "
                         "e.g. --balance 4,4")
    if sum(args.balance) != num_layers:
        parser.error(f"--balance {args.balance} sums to {sum(args.balance)} but the {args.model} "
                     f"has {num_layers} layers; e.g. --balance "
                     f"{num_layers // 2},{num_layers - num_layers // 2}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; fix: --device cpu")
    return args


def devices_of(args: argparse.Namespace) -> list[torch.device]:
    if args.device == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", j % count) for j in range(len(args.balance))]
    return [torch.device("cpu")] * len(args.balance)


def build(name: str, args: argparse.Namespace, checkpoint: str) -> nn.Module:
    """The model ``name`` times: the same weights for all three."""
    base = build_model(args)
    devices = devices_of(args)
    if name == "pipetrain":
        import pipetrain

        options: dict[str, Any] = {}
        if args.recompute_ahead is not None:
            options["recompute_ahead"] = args.recompute_ahead
        if args.reuse_gradient_buffers:
            options["reuse_gradient_buffers"] = True
        if args.throttle_openmp_spin:
            options["throttle_openmp_spin"] = True
        return pipetrain.GPipe(base, args.balance, devices=devices, chunks=args.chunks,
                               checkpoint=checkpoint, **options)
    if name == "torchgpipe":
        import torchgpipe

        return torchgpipe.GPipe(base, args.balance, devices=devices, chunks=args.chunks,
                                checkpoint=checkpoint)
    return base.to(devices[0])


def child(name: str, args: argparse.Namespace, checkpoint: str, conn: Connection) -> None:
    """One implementation in its own process: its first step's peak memory and its
    output, then timed steps on demand, then the run's peak memory."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = build(name, args, checkpoint)
    devices = devices_of(args)
    batch = make_batch(args, devices[0])
    step = make_step(model, batch, devices[0])
    meter = PeakMemory(devices) if available(devices) else None
    if meter is not None:
        meter.start()
    step()  # the first step: its peak memory (the high-water mark is not reset later)
    first = meter.peak_mib() if meter is not None else None
    seen: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
             for layer in model.modules() if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        output = model(batch).float().cpu()
    for hook in hooks:
        hook.remove()
    conn.send((output, sorted(set(seen)), torch.get_num_threads(), first))
    while True:
        request = conn.recv()
        if request is None:
            conn.send(meter.peak_mib() if meter is not None else None)
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


def run_mode(args: argparse.Namespace, checkpoint: str) -> dict[str, Any]:
    """The three implementations in fresh processes, for one checkpoint mode."""
    context = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    processes = []
    for name in NAMES:
        parent_end, child_end = context.Pipe()
        process = context.Process(target=child, args=(name, args, checkpoint, child_end),
                                  daemon=True)
        process.start()
        conns[name] = parent_end
        processes.append(process)
    try:
        return _coordinate(args, checkpoint, conns)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def _coordinate(args: argparse.Namespace, checkpoint: str,
                conns: dict[str, Connection]) -> dict[str, Any]:
    # the three compute the same function of the same weights; record the intra-op
    # thread counts their layers run with
    threads_seen: dict[str, list[int]] = {}
    torch_threads = 0
    outputs, first_mib = {}, {}
    for name in NAMES:
        outputs[name], threads_seen[name], torch_threads, first_mib[name] = conns[name].recv()
    reference = outputs["plain"]
    for name in NAMES:
        diff = (outputs[name] - reference).abs().max().item()
        if diff > 1e-4 * max(1.0, reference.abs().max().item()):
            raise RuntimeError(f"{name} output differs from plain by {diff:.3g}")
    result: dict[str, Any] = {
        "checkpoint": checkpoint,
        "torch_threads": torch_threads,
        "intra_op_threads_in_layers": threads_seen,
        "first_step_peak_mib": first_mib,
    }
    if not args.memory_only:
        result.update(_time(args, conns))
    run_mib = {}
    for name in NAMES:
        conns[name].send(None)
        run_mib[name] = conns[name].recv()
    result["run_peak_mib"] = run_mib
    for key in ("first_step_peak_mib", "run_peak_mib"):
        mib = result[key]
        if mib["pipetrain"] is not None and mib["torchgpipe"]:
            result[key.replace("_mib", "_pipetrain_over_torchgpipe")] = \
                mib["pipetrain"] / mib["torchgpipe"]
    return result


def _time(args: argparse.Namespace, conns: dict[str, Connection]) -> dict[str, Any]:
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
    return {
        "median_step_ms": {name: medians[name] * 1e3 for name in NAMES},
        "quartiles_step_ms": {name: [q * 1e3 for q in quartiles[name]] for name in NAMES},
        "throughput_samples_per_s": throughput,
        "ratio_pipetrain_over_torchgpipe": throughput["pipetrain"] / throughput["torchgpipe"],
        "ratio_pipetrain_over_plain": throughput["pipetrain"] / throughput["plain"],
    }


def _model_name(args: argparse.Namespace) -> str:
    if args.model == "gpt":
        return (f"GPT: {args.depth} blocks, width {args.width}, {args.heads} heads, "
                f"{args.seq} tokens")
    act = "GELU" if args.activation == "gelu" else "ReLU"
    return f"{args.depth} x [Linear({args.width}, {args.width}) + {act}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torchgpipe
    except ImportError:
        print("torchgpipe is not installed; fix: pip install torchgpipe==0.0.7", file=sys.stderr)
        return 2
    modes = MODES if args.checkpoint == "all" else (args.checkpoint,)
    try:
        results = [run_mode(args, mode) for mode in modes]
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    setting = {
        "model": _model_name(args), "batch": args.batch, "chunks": args.chunks,
        "balance": args.balance, "device": args.device,
        "repetitions": None if args.memory_only else args.repetitions,
        "warmup": args.warmup, "block": args.block, "cpus": os.cpu_count(),
        "processes": "one per implementation and mode",
        "pipetrain_options": {"recompute_ahead": args.recompute_ahead,
                              "reuse_gradient_buffers": args.reuse_gradient_buffers,
                              "throttle_openmp_spin": args.throttle_openmp_spin},
        "torch": torch.__version__, "torchgpipe": torchgpipe.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps({"setting": setting, "results": results}))
        return 0
    _print(args, setting, results)
    return 0


def _print(args: argparse.Namespace, setting: dict[str, Any], results: list[dict[str, Any]]) -> None:
    unit = "CUDA allocator peak" if args.device == "cuda" else "RSS growth"
    print(f"{setting['model']}, batch {args.batch}, balance {args.balance}, chunks "
          f"{args.chunks}, on {args.device}, {setting['cpus']} CPUs; memory: {unit} (MiB)")
    for result in results:
        print(f"\ncheckpoint={result['checkpoint']}: {result['torch_threads']} torch threads, "
              f"intra-op threads in the layers: {result['intra_op_threads_in_layers']}")
        timed = "median_step_ms" in result
        header = f"{'':<12}{'1st step MiB':>14}{'run MiB':>10}"
        if timed:
            header += f"{'median ms':>12}{'IQR ms':>18}{'samples/s':>12}"
        print(header)
        for name in NAMES:
            first, run = result["first_step_peak_mib"][name], result["run_peak_mib"][name]
            line = f"{name:<12}{_mib(first):>14}{_mib(run):>10}"
            if timed:
                q1, _, q3 = result["quartiles_step_ms"][name]
                line += (f"{result['median_step_ms'][name]:>12.2f}{f'{q1:.2f}-{q3:.2f}':>18}"
                         f"{result['throughput_samples_per_s'][name]:>12.0f}")
            print(line)
        if "first_step_peak_pipetrain_over_torchgpipe" in result:
            print(f"pipetrain / torchgpipe peak memory: first step "
                  f"{result['first_step_peak_pipetrain_over_torchgpipe']:.2f}x, run "
                  f"{result['run_peak_pipetrain_over_torchgpipe']:.2f}x")
        if timed:
            print(f"pipetrain / torchgpipe throughput: "
                  f"{result['ratio_pipetrain_over_torchgpipe']:.2f}x; pipetrain / plain: "
                  f"{result['ratio_pipetrain_over_plain']:.2f}x")


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
