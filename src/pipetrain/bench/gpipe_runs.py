"""pipetrain.GPipe, torchgpipe.GPipe and plain nn.Sequential, each in its own process, timed in turn.

The engine of case ``gpipe_vs_torchgpipe`` (:mod:`pipetrain.bench.cases.gpipe_vs_torchgpipe`).
It measures the wall time and the peak memory of a training step (forward,
``loss.backward()``, ``zero_grad``) of the SAME model (identical initial weights) on the
SAME batch, three ways:

- ``pipetrain``: ``pipetrain.GPipe(model, balance, chunks=..., checkpoint=...)`` with its
  default options (unless the setting asks for opt-in ones); every partition runs on its
  own persistent worker thread, also when partitions share the CPU;
- ``torchgpipe``: ``torchgpipe.GPipe`` 0.0.7 with the same balance, chunks and checkpoint
  mode and devices (it runs the partitions of one device on one thread);
- ``plain``: the ``nn.Sequential`` itself (no micro-batches, no recomputation);
- ``torchgpipe@1``: torchgpipe again at one intra-op thread (on the CPU, when the setting
  times): its best setting on a small CPU, where its device thread and autograd's each
  start an OpenMP team. pipetrain is compared with the faster of torchgpipe's two runs
  (``torchgpipe_anchor`` in the result), for its time and its memory.

Each of the three runs in its own process, as its users would run it (with
``throttle_openmp_spin``, pipetrain's stage workers change process-wide OpenMP state; and
memory is only comparable between processes). The parent checks that the three outputs
agree.

Models: ``mlp``, ``depth`` x [Linear(width, width) + activation] (each pair one child);
``gpt``, pipetrain's GPT (``pipetrain.models.gpt``: embedding, ``depth`` pre-LayerNorm
transformer blocks, head; ``width`` channels, ``heads``, ``seq`` tokens, no dropout,
untied embeddings) whose balance covers ``depth + 2`` layers. The loss is the mean
square of the output (logits for the GPT).

Memory: each process measures the peak over its FIRST step (RSS growth on the CPU, from
right after building the model; the CUDA allocator's peak on a GPU; see
:mod:`pipetrain.bench.harness.memory`), and the peak over the whole run (first step,
warm-up and timed steps: what training with it needs). ``memory_only`` skips the timing.

Timing: after a warm-up, the timed steps are interleaved round-robin across the three
(the starting one rotates) in blocks of ``block`` consecutive steps, each block after
one untimed step, so that a slow period of a shared machine hits all three alike while
each is timed as in its own training loop. Medians are reported, with throughput
(samples/s) and the ratios pipetrain / torchgpipe and pipetrain / plain (of throughput:
above 1 means pipetrain is faster).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from pipetrain.bench.harness.memory import PeakMemory, memory_available

__all__ = ["ANSWER_S", "MODES", "NAMES", "ONE_THREAD", "Setting", "build_model", "library",
           "make_batch", "make_step", "run_mode", "runners"]

NAMES = ("pipetrain", "torchgpipe", "plain")
ONE_THREAD = "@1"
"""Suffix of a runner run at one intra-op thread (``torchgpipe@1``): torchgpipe's best
setting on a small CPU, where its device thread and autograd's each start an OpenMP team."""
MODES = ("never", "except_last", "always")
ANSWER_S = 900.0
"""Seconds an implementation's process may take to answer (build, or a batch of steps)."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """The model, batch, pipeline, repetitions and pipetrain's options of one comparison."""

    model: str = "mlp"
    """``mlp`` or ``gpt``."""
    width: int = 512
    depth: int = 8
    """Linear+activation children (mlp) or transformer blocks (gpt)."""
    activation: str = "relu"
    """The mlp's activation: ``relu`` or ``gelu``."""
    heads: int = 4
    seq: int = 128
    batch: int = 256
    chunks: int = 4
    balance: tuple[int, ...] = (4, 4)
    device: str = "cpu"
    """``cuda``: partition j on cuda:(j mod the number of GPUs)."""
    repetitions: int = 30
    warmup: int = 5
    block: int = 5
    """Consecutive timed steps of one implementation per turn."""
    memory_only: bool = False
    threads: int | None = None
    """``torch.set_num_threads`` in each process (``None``: torch's choice)."""
    pipetrain_options: dict[str, Any] = field(default_factory=dict)
    """Keywords of ``pipetrain.GPipe`` beyond the defaults (the opt-in CPU tricks)."""
    seed: int = 0
    anchor_one_thread: bool = True
    """Time torchgpipe at one intra-op thread too (``torchgpipe@1``, on the CPU, unless
    ``threads`` is 1 already) and compare pipetrain with its faster run."""

    def __post_init__(self) -> None:
        num_layers = self.depth + 2 if self.model == "gpt" else self.depth
        if sum(self.balance) != num_layers:
            raise ValueError(f"balance {list(self.balance)} sums to {sum(self.balance)} but "
                             f"the {self.model} has {num_layers} layers; e.g. balance="
                             f"({num_layers // 2}, {num_layers - num_layers // 2})")

    def describe(self) -> str:
        """The model in words.

        Example:
            >>> Setting().describe()
            '8 x [Linear(512, 512) + ReLU]'
        """
        if self.model == "gpt":
            return (f"GPT: {self.depth} blocks, width {self.width}, {self.heads} heads, "
                    f"{self.seq} tokens")
        act = "GELU" if self.activation == "gelu" else "ReLU"
        return f"{self.depth} x [Linear({self.width}, {self.width}) + {act}]"


def library(runner: str) -> str:
    """What ``runner`` trains with (``torchgpipe@1`` is ``torchgpipe`` at one thread).

    Example:
        >>> library("torchgpipe@1"), library("plain")
        ('torchgpipe', 'plain')
    """
    return runner.removesuffix(ONE_THREAD)


def runners(setting: Setting) -> tuple[str, ...]:
    """The runners of one setting: the three, and ``torchgpipe@1`` where it is timed.

    Example:
        >>> runners(Setting())
        ('pipetrain', 'torchgpipe', 'plain', 'torchgpipe@1')
        >>> runners(Setting(threads=1))
        ('pipetrain', 'torchgpipe', 'plain')
    """
    one_thread = (setting.anchor_one_thread and not setting.memory_only
                  and setting.device == "cpu" and setting.threads != 1)
    return (*NAMES, f"torchgpipe{ONE_THREAD}") if one_thread else NAMES


def build_model(setting: Any) -> nn.Sequential:
    """The benchmark's model, seeded: the same weights in every process (``setting``: a
    :class:`Setting`, or any object with its ``model``, ``depth``, ``width``, ``heads``,
    ``seq``, ``activation`` and ``seed``)."""
    torch.manual_seed(setting.seed)
    if setting.model == "gpt":
        from pipetrain.models.gpt import GPTConfig, build_gpt

        config = GPTConfig(num_layers=setting.depth, width=setting.width,
                           num_heads=setting.heads, context=setting.seq, tie_embeddings=False)
        return build_gpt(config, seed=setting.seed)
    activation = nn.GELU if setting.activation == "gelu" else nn.ReLU
    return nn.Sequential(*[nn.Sequential(nn.Linear(setting.width, setting.width), activation())
                           for _ in range(setting.depth)])


def make_batch(setting: Any, device: torch.device) -> torch.Tensor:
    """The benchmark's batch, seeded (tokens for the GPT, features for the MLP)."""
    torch.manual_seed(setting.seed + 1)
    if setting.model == "gpt":
        return torch.randint(0, 256, (setting.batch, setting.seq), device=device)
    return torch.randn(setting.batch, setting.width, device=device)


def make_step(model: nn.Module, batch: torch.Tensor, device: torch.device) -> Callable[[], None]:
    """One training step: forward, the mean square of the output backward, ``zero_grad``."""

    def step() -> None:
        output = model(batch)
        output.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _devices(setting: Setting) -> list[torch.device]:
    if setting.device == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", j % count) for j in range(len(setting.balance))]
    return [torch.device("cpu")] * len(setting.balance)


def _build(name: str, setting: Setting, checkpoint: str) -> nn.Module:
    """The model ``name`` times: the same weights for all three."""
    base = build_model(setting)
    devices = _devices(setting)
    if name == "pipetrain":
        import pipetrain

        ours: nn.Module = pipetrain.GPipe(base, list(setting.balance), devices=devices,
                                          chunks=setting.chunks, checkpoint=checkpoint,
                                          **setting.pipetrain_options)
        return ours
    if name == "torchgpipe":
        import torchgpipe

        gpipe: nn.Module = torchgpipe.GPipe(base, list(setting.balance), devices=devices,
                                            chunks=setting.chunks, checkpoint=checkpoint)
        return gpipe
    return base.to(devices[0])


def _child(name: str, setting: Setting, checkpoint: str, conn: Connection) -> None:
    """One implementation in its own process: its first step's peak memory and its
    output, then timed steps on demand, then the run's peak memory."""
    threads = 1 if name.endswith(ONE_THREAD) else setting.threads
    if threads is not None:
        torch.set_num_threads(threads)
    model = _build(library(name), setting, checkpoint)
    devices = _devices(setting)
    batch = make_batch(setting, devices[0])
    step = make_step(model, batch, devices[0])
    meter = PeakMemory(devices) if memory_available(devices) else None
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


def run_mode(setting: Setting, checkpoint: str) -> dict[str, Any]:
    """The implementations in fresh processes (:func:`runners`), for one checkpoint mode;
    their outputs checked against each other, their peaks and (unless ``memory_only``)
    times.

    Raises:
        RuntimeError: an implementation's output differs from plain's, or its process
            crashed or did not answer.

    Example::

        result = run_mode(Setting(repetitions=10), "except_last")
        result["ratio_pipetrain_over_torchgpipe"]   # throughput; above 1: pipetrain faster
    """
    context = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    processes = []
    for name in runners(setting):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_child, args=(name, setting, checkpoint, child_end),
                                  daemon=True)
        process.start()
        conns[name] = parent_end
        processes.append(process)
    try:
        return _coordinate(setting, checkpoint, conns)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def _recv(conns: dict[str, Connection], name: str) -> Any:
    """The next answer of implementation ``name``'s process; an error naming it if it
    died or did not answer within :data:`ANSWER_S`."""
    conn = conns[name]
    try:
        if not conn.poll(ANSWER_S):
            raise RuntimeError(f"the {name} process did not answer within {ANSWER_S:.0f} s")
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the {name} process ended without answering (it crashed; its "
                           "error is above, on stderr)") from None


def _coordinate(setting: Setting, checkpoint: str,
                conns: dict[str, Connection]) -> dict[str, Any]:
    # all compute the same function of the same weights; record the intra-op thread
    # counts their layers run with
    names = list(conns)
    threads_seen: dict[str, list[int]] = {}
    torch_threads = 0
    outputs, first_mib = {}, {}
    for name in names:
        outputs[name], threads_seen[name], threads, first_mib[name] = _recv(conns, name)
        if not name.endswith(ONE_THREAD):
            torch_threads = threads
    reference = outputs["plain"]
    for name in names:
        diff = (outputs[name] - reference).abs().max().item()
        if diff > 1e-4 * max(1.0, reference.abs().max().item()):
            raise RuntimeError(f"{name} output differs from plain by {diff:.3g}")
    result: dict[str, Any] = {
        "checkpoint": checkpoint,
        "torch_threads": torch_threads,
        "intra_op_threads_in_layers": threads_seen,
        "first_step_peak_mib": first_mib,
    }
    anchor = "torchgpipe"
    if not setting.memory_only:
        result.update(_time(setting, conns))
        anchor = result["torchgpipe_anchor"]
    run_mib = {}
    for name in names:
        conns[name].send(None)
        run_mib[name] = _recv(conns, name)
    result["run_peak_mib"] = run_mib
    for key in ("first_step_peak_mib", "run_peak_mib"):
        mib = result[key]
        if mib["pipetrain"] is not None and mib[anchor]:
            result[key.replace("_mib", "_pipetrain_over_torchgpipe")] = \
                mib["pipetrain"] / mib[anchor]
    return result


def _time(setting: Setting, conns: dict[str, Connection]) -> dict[str, Any]:
    names = list(conns)
    for name in names:
        conns[name].send((setting.warmup, 0))
        _recv(conns, name)
    times: dict[str, list[float]] = {name: [] for name in names}
    num_rounds = -(-setting.repetitions // setting.block)
    for r in range(num_rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            # one untimed step first: the previous implementation's threads settle
            conns[name].send((1, min(setting.block, setting.repetitions - r * setting.block)))
            times[name].extend(_recv(conns, name))
    medians = {name: statistics.median(times[name]) for name in names}
    quartiles = {name: statistics.quantiles(times[name], n=4) if len(times[name]) > 1
                 else [times[name][0]] * 3 for name in names}
    throughput = {name: setting.batch / medians[name] for name in names}
    anchor = min((n for n in names if library(n) == "torchgpipe"), key=medians.__getitem__)
    return {
        "torchgpipe_anchor": anchor,
        "median_step_ms": {name: medians[name] * 1e3 for name in names},
        "step_ms": {name: [t * 1e3 for t in times[name]] for name in names},
        "quartiles_step_ms": {name: [q * 1e3 for q in quartiles[name]] for name in names},
        "throughput_samples_per_s": throughput,
        "ratio_pipetrain_over_torchgpipe": throughput["pipetrain"] / throughput[anchor],
        "ratio_pipetrain_over_plain": throughput["pipetrain"] / throughput["plain"],
    }
