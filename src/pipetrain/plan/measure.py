"""Timing one layer: forward, backward and the backward's two halves, repeated; medians.

These are the profiler's timing primitives (see :mod:`pipetrain.plan.profiler` for what
each measured field counts). A *pass* runs a layer on a fresh copy of its input, whose
tensors that need a gradient are new leaves (cloned once more, so that a layer working
in place does not write to a leaf); the backward passes are the runtime's own
(:mod:`pipetrain.backward.split`, imported so that the halves measured are the
halves that run), with a gradient of ones for every output that needs one, or from the
scalar ``loss_fn(output, target)`` for the last layer.

Two ways to repeat: :func:`time_layer` times one layer round after round (the profiler's
way: a layer at a time, so a model too big for the device is measured layer by layer);
:func:`time_in_order` times a whole sequence pass after pass, in order, for a time
budget (torchgpipe's way, which :func:`pipetrain.partition.balance_by_time` keeps: layers
that hand tensors to later layers outside their output, ``@skippable`` stash and pop,
run as in a plain forward).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from pipetrain.backward.fused import fused_backward
from pipetrain.backward.split import backward_input
from pipetrain.nested import iter_tensors, map_tensors

__all__ = [
    "LossFn",
    "Pass",
    "Sample",
    "Timings",
    "cache_flush_buffer",
    "core_cache_bytes",
    "last_level_cache_bytes",
    "median_time",
    "relative_spread",
    "time_in_order",
    "time_layer",
    "time_optimizer_step",
]

LossFn = Callable[[Any, Any], Tensor]
"""``loss_fn(output, target) -> scalar``, as the last pipeline stage computes it."""


@dataclass
class Pass:
    """One forward of a layer on a fresh copy of its input; ready for one backward.

    Example:
        >>> layer = nn.Linear(3, 2)
        >>> run = Pass.prepare(torch.ones(4, 3, requires_grad=True), torch.device("cpu"))
        >>> run.forward(layer, None, None)
        >>> run.backward(list(layer.parameters()))
        >>> layer.weight.grad.shape, run.leaves[0].grad is None  # input gradients: returned
        (torch.Size([2, 3]), True)
    """

    leaves: list[Tensor]
    """The copies of the input's tensors that need a gradient (the backward's inputs)."""
    value: Any
    """The input as the layer receives it."""
    output: Any = None
    roots: list[Tensor] = field(default_factory=list)
    """What the backward starts from: the loss, or the outputs that need a gradient."""
    grads: list[Tensor | None] = field(default_factory=list)

    @staticmethod
    def prepare(value: Any, device: torch.device) -> Pass:
        """A copy of ``value`` on ``device``, cut from any graph, needing grad where it did.

        Example:
            >>> p = Pass.prepare((torch.ones(2, requires_grad=True), 3), torch.device("cpu"))
            >>> len(p.leaves), p.value[0].is_leaf, p.value[1]
            (1, False, 3)
        """
        leaves: list[Tensor] = []

        def fresh(tensor: Tensor) -> Tensor:
            copy = tensor.detach().to(device, copy=True)
            if not tensor.requires_grad:
                return copy
            leaves.append(copy.requires_grad_())
            return copy.clone()

        return Pass(leaves, map_tensors(fresh, value))

    def forward(self, layer: nn.Module, loss_fn: LossFn | None, target: Any) -> None:
        """Run ``layer`` (and ``loss_fn`` when given) and set what the backward starts from."""
        self.output = layer(self.value)
        self.start_backward(loss_fn, target)

    def start_backward(self, loss_fn: LossFn | None, target: Any) -> None:
        """Set the backward's roots: ``loss_fn(output, target)``, else every output that
        needs a gradient (with a gradient of ones)."""
        if loss_fn is not None:
            loss = loss_fn(self.output, target)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {shape}; fix: reduce it, "
                    "e.g. loss_fn=lambda out, y: F.cross_entropy(out, y) (mean)"
                )
            self.roots = [loss] if loss.requires_grad else []
            self.grads = [None] * len(self.roots)
        else:
            self.roots = [t for t in iter_tensors(self.output) if t.requires_grad]
            self.grads = [torch.ones_like(t) for t in self.roots]

    def backward(self, params: list[nn.Parameter]) -> None:
        """The whole backward, as the runtime runs it (gradients accumulate in ``.grad``)."""
        if self.roots:
            fused_backward(self.roots, self.grads, self.leaves, params)

    def detached_output(self) -> Any:
        """The output cut from the graph (what the next layer is fed)."""
        return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), self.output)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Sample(NamedTuple):
    """One timed region: wall-clock seconds, and the process's CPU seconds meanwhile
    (None on CUDA, where the CPU waits for the device).

    Example:
        >>> Sample(0.010, 0.001).preempted, Sample(0.010, 0.0098).preempted
        (True, False)
    """

    wall: float
    cpu: float | None = None

    @property
    def preempted(self) -> bool:
        """Whether the process lost the CPU for over a quarter of the region."""
        return self.cpu is not None and self.cpu < 0.75 * self.wall


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's garbage collector paused (a collection takes milliseconds), as timeit does."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def _timed(samples: list[Sample], keep: bool, device: torch.device) -> Iterator[None]:
    """Append the time the block takes to ``samples`` if ``keep``."""
    _synchronize(device)
    cpu = time.process_time()
    start = time.perf_counter()
    yield
    _synchronize(device)
    wall = time.perf_counter() - start
    if keep:
        on_cpu = device.type == "cpu"
        samples.append(Sample(wall, time.process_time() - cpu if on_cpu else None))


@dataclass
class Timings:
    """Each repetition of each pass (summed up by :func:`median_time`).

    Example:
        >>> timings = Timings(forward=[Sample(0.002, 0.002), Sample(0.003, 0.003)])
        >>> median_time(timings.forward, digits=3), median_time(timings.backward, digits=3)
        (0.0025, 0.0)
    """

    forward: list[Sample] = field(default_factory=list)
    backward: list[Sample] = field(default_factory=list)
    backward_input: list[Sample] = field(default_factory=list)
    backward_weight: list[Sample] = field(default_factory=list)


def relative_spread(samples: list[Sample]) -> float:
    """How much the repetitions disagree: the interquartile range of the wall times that
    kept the CPU, over their median (0 with fewer than 4 samples, or a zero median).

    Example:
        >>> relative_spread([Sample(1.0), Sample(1.1), Sample(0.9), Sample(1.0), Sample(1.2)])
        0.2
    """
    kept = [s.wall for s in samples if not s.preempted] or [s.wall for s in samples]
    if len(kept) < 4:
        return 0.0
    low, _, high = statistics.quantiles(kept, n=4)
    middle = statistics.median(kept)
    return round((high - low) / middle, 3) if middle > 0 else 0.0


def median_time(samples: list[Sample], *, digits: int) -> float:
    """The median wall time of the samples that kept the CPU (of all, if none did),
    rounded to ``digits`` significant digits; 0 without samples.

    On a shared CPU, another process preempting this one inflates some repetitions
    many times over, and often more than half of one pass's repetitions (the time
    slices fall on the same phase of every round), which a plain median does not survive.

    Example:
        >>> median_time([Sample(0.0012345, 0.0012), Sample(0.0011, 0.0011),
        ...              Sample(0.0099, 0.0013), Sample(0.0098, 0.0012)], digits=3)
        0.00117
    """
    if not samples:
        return 0.0
    kept = [s.wall for s in samples if not s.preempted] or [s.wall for s in samples]
    return float(f"{statistics.median(kept):.{digits}g}")


def time_layer(
    layer: nn.Module,
    value: Any,
    *,
    device: torch.device,
    warmup: int,
    repetitions: int,
    loss_fn: LossFn | None = None,
    target: Any = None,
) -> tuple[Timings, Any]:
    """Time ``warmup + repetitions`` rounds on ``value``; keep the last ``repetitions``.

    A round is a forward and a whole backward (:func:`fused_backward`) and, when the
    layer has trainable parameters, a second forward and the split backward
    (:func:`backward_input`, then its weight pass); both forwards are timed. On CUDA the
    device is synchronized at the start and end of every timed region; Python's garbage
    collector is paused meanwhile (a collection takes milliseconds), as :mod:`timeit` does. Returns the
    timings and the last forward's output, detached. Gradients accumulate in the
    layer's ``.grad`` as over the micro-batches of a step.

    Example:
        >>> timings, out = time_layer(nn.Linear(4, 4), torch.ones(2, 4),
        ...                           device=torch.device("cpu"), warmup=1, repetitions=3)
        >>> len(timings.forward), len(timings.backward_weight), out.shape
        (6, 3, torch.Size([2, 4]))
    """
    params = [p for p in layer.parameters() if p.requires_grad]
    timings = Timings()
    with _gc_paused():
        output = _rounds(layer, value, params, timings, device=device, warmup=warmup,
                         repetitions=repetitions, loss_fn=loss_fn, target=target)
    return timings, output


def _whole_pass(layer: nn.Module, value: Any, params: list[nn.Parameter], timings: Timings, *,
                keep: bool, device: torch.device, loss_fn: LossFn | None = None,
                target: Any = None) -> Any:
    """One timed forward and whole backward of ``layer`` on a fresh copy of ``value``;
    the output, detached."""
    whole = Pass.prepare(value, device)
    with _timed(timings.forward, keep, device):
        whole.forward(layer, loss_fn, target)
    with _timed(timings.backward, keep, device):
        whole.backward(params)
    return whole.detached_output()


def _rounds(layer: nn.Module, value: Any, params: list[nn.Parameter], timings: Timings, *,
            device: torch.device, warmup: int, repetitions: int, loss_fn: LossFn | None,
            target: Any) -> Any:
    output: Any = None
    for round_index in range(warmup + repetitions):
        keep = round_index >= warmup
        output = _whole_pass(layer, value, params, timings, keep=keep, device=device,
                             loss_fn=loss_fn, target=target)
        if not params:
            continue
        split = Pass.prepare(value, device)
        with _timed(timings.forward, keep, device):
            split.forward(layer, loss_fn, target)
        with _timed(timings.backward_input, keep, device):
            _, weight = backward_input(split.roots, split.grads, split.leaves, params)
        with _timed(timings.backward_weight, keep, device):
            weight.run()
        del split, weight
    return output


def time_in_order(
    layers: Sequence[Callable[[], nn.Module]],
    value: Any,
    *,
    device: torch.device,
    timeout: float,
) -> list[Timings]:
    """Time every layer's forward and whole backward, pass after pass over the sequence
    in order, until ``timeout`` seconds have gone by (at least one pass).

    A pass builds each layer anew (``layers[j]()``: only one is alive at a time), runs
    it on the previous layer's output (the first on ``value``) and backward from a
    gradient of ones as :func:`time_layer` does; the timed regions are the same. Tensors
    a layer hands to a later one outside its output (a skip connection's stash and pop)
    get there as in a plain forward; a backward stops at its own layer's inputs. Returns
    each layer's timings (``forward`` and ``backward``, one sample per pass).

    Example:
        >>> timings = time_in_order([lambda: nn.Linear(4, 4), nn.ReLU], torch.ones(2, 4),
        ...                         device=torch.device("cpu"), timeout=0.0)
        >>> [(len(t.forward), len(t.backward)) for t in timings]
        [(1, 1), (1, 1)]
    """
    timings = [Timings() for _ in layers]
    started = time.perf_counter()
    while True:
        current = value
        for build, timed in zip(layers, timings):
            layer = build()
            params = [p for p in layer.parameters() if p.requires_grad]
            with _gc_paused():
                current = _whole_pass(layer, current, params, timed, keep=True, device=device)
            del layer
        if time.perf_counter() - started >= timeout:
            return timings


_FALLBACK_CACHE_BYTES = 32 << 20
_MAX_CACHE_BYTES = 512 << 20
_FALLBACK_CORE_BYTES = 1 << 20


@functools.cache
def _cache_sizes() -> dict[int, int]:
    """The largest cache of each level of CPU 0, from Linux's sysfs (empty if unreadable)."""
    sizes: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            level = int((index / "level").read_text())
            sizes[level] = max(sizes.get(level, 0), int(text.rstrip("KMG")) * scale)
    return sizes


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this machine, from Linux's sysfs (32 MiB where it cannot
    be read; at most 512 MiB).

    Example:
        >>> last_level_cache_bytes() >= 1 << 20
        True
    """
    return min(max(_cache_sizes().values(), default=_FALLBACK_CACHE_BYTES), _MAX_CACHE_BYTES)


def core_cache_bytes() -> int:
    """A core's own cache (its level-2 cache; 1 MiB where it cannot be read): an
    optimizer step whose tensors fit in it is timed without flushing the caches first.

    Example:
        >>> core_cache_bytes() >= 64 << 10
        True
    """
    return _cache_sizes().get(2, _FALLBACK_CORE_BYTES)


def cache_flush_buffer() -> torch.Tensor:
    """A CPU buffer twice the last-level cache: writing it evicts what the caches held.
    Reuse one for many measurements (a new one is page-faulted in on its first write).

    Example:
        >>> cache_flush_buffer().numel() == 2 * last_level_cache_bytes()
        True
    """
    return torch.empty(2 * last_level_cache_bytes(), dtype=torch.uint8)


def time_optimizer_step(
    params: list[nn.Parameter],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    device: torch.device,
    warmup: int,
    repetitions: int,
    flush: torch.Tensor | None = None,
) -> list[Sample]:
    """Time ``warmup + repetitions`` calls of ``step()`` of ``optimizer(params)`` (on the
    gradients the parameters hold, which it updates); keep the last ``repetitions``. The
    first step creates the optimizer's state, so at least one untimed step runs. On the
    CPU each call follows writes to ``flush`` (default: a new :func:`cache_flush_buffer`),
    which evict the step's tensors from the caches, as a training step finds them; unless
    those tensors (parameters, gradients, optimizer state) fit in a core's own cache
    (:func:`core_cache_bytes`), where a cold step costs at most the microseconds of reading
    them once, and the flush (twice the last-level cache, tens of milliseconds) would cost
    far more than the step it prepares.

    Example:
        >>> layer = nn.Linear(4, 4)
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> samples = time_optimizer_step(list(layer.parameters()), torch.optim.AdamW,
        ...                               device=torch.device("cpu"), warmup=0, repetitions=3)
        >>> len(samples)
        3
    """
    trainable = [p for p in params if p.requires_grad and p.grad is not None]
    if not trainable:
        return []
    built = optimizer(trainable)
    samples: list[Sample] = []
    with _gc_paused():
        for round_index in range(max(1, warmup) + repetitions):
            if round_index == 1 and device.type == "cpu":  # the state exists from step 1 on
                if _step_bytes(trainable, built) <= core_cache_bytes():
                    flush = None
                elif flush is None:
                    flush = cache_flush_buffer()
            if round_index and flush is not None:
                flush.fill_(round_index % 251)  # evict the step's tensors from the cache
            with _timed(samples, round_index >= max(1, warmup), device):
                built.step()
    return samples


def _step_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes an optimizer step reads: the parameters, their gradients and their state."""
    tensors = [t for p in params for t in (p, p.grad, *optimizer.state.get(p, {}).values())
               if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
