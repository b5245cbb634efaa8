"""Random streams: torch's generators seeded per (seed, layer, micro-batch) before each layer.

A layer that draws random numbers (``nn.Dropout``, a functional ``F.dropout`` or
``torch.rand`` inside a custom layer, the dropout of ``F.scaled_dot_product_attention``)
must draw the same numbers when a checkpointed micro-batch is recomputed, and, for a
pipeline's result not to depend on where the model is cut, the same numbers whichever
stage, thread or process runs the layer. A stage therefore runs its layers one by one
and, before each, seeds torch's generators (the CPU one, and its GPU's when it runs on
one) from ``mix_seed(seed, global layer index, micro-batch index)``. The caller's
generator states are saved before the stage runs and restored after it, so code around
the pipeline (a loop drawing its batches from torch's generator on every rank) sees the
same state on every rank, however the layers are spread. No list of layer types decides
what is seeded: every layer is (about 3 microseconds per layer and micro-batch).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LayerHook", "RandomStreams", "mix_seed", "seeded_layers", "seeding_hooks"]

LayerHook = Callable[[int], None]
"""Called with a layer's global index right before the layer runs."""


def mix_seed(*numbers: int) -> int:
    """A well-spread 63-bit seed from small, correlated integers (splitmix64).

    Example:
        >>> mix_seed(0, 1) != mix_seed(1, 0)
        True
    """
    state = 0x9E3779B97F4A7C15
    for number in numbers:
        state = (state ^ (number & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & 0x7FFFFFFFFFFFFFFF


def generators(device: torch.device) -> list[torch.Generator]:
    """The generators a layer on ``device`` draws from: the CPU one, plus the GPU's.

    Example:
        >>> generators(torch.device("cpu")) == [torch.default_generator]
        True
    """
    found = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]  # creates the per-device generators
        index = device.index if device.index is not None else torch.cuda.current_device()
        found.append(torch.cuda.default_generators[index])
    return found


@contextlib.contextmanager
def seeded_layers(seed: int, microbatch: int, device: torch.device) -> Iterator[LayerHook]:
    """Yield the hook that seeds the generators for layer ``l`` of micro-batch
    ``microbatch`` from ``mix_seed(seed, l, microbatch)``; the generators' states are
    restored when the block ends.

    Example:
        >>> before = torch.default_generator.get_state()
        >>> draws = []
        >>> for _ in range(2):
        ...     with seeded_layers(7, 0, torch.device("cpu")) as enter:
        ...         enter(3)
        ...         draws.append(torch.rand(2))
        >>> torch.equal(draws[0], draws[1]), torch.equal(before, torch.default_generator.get_state())
        (True, True)
    """
    found = generators(device)
    saved = [g.get_state() for g in found]

    def enter(layer: int) -> None:
        layer_seed = mix_seed(seed, layer, microbatch)
        for generator in found:
            generator.manual_seed(layer_seed)

    try:
        yield enter
    finally:
        for generator, state in zip(found, saved):
            generator.set_state(state)


class RandomStreams:
    """The random streams of a pipeline's stages, one per (layer, micro-batch) of a step.

    Set :attr:`seed` once per step (e.g. ``mix_seed(config seed, step)``); a stage wraps
    every forward (and recomputation) of micro-batch ``i`` in :meth:`scope`, and calls the
    hook it yields before each layer. The micro-batch index in the key is the micro-batch's
    index in the whole batch (replicas included). Stages must not draw in parallel threads of one process
    (:class:`~pipetrain.api.random_streams.SessionRng` adds the lock for that).

    Example:
        >>> streams = RandomStreams(seed=5)
        >>> masks = []
        >>> for _ in range(2):  # a forward and its recomputation
        ...     with streams.scope(stage=0, microbatch=1, device=torch.device("cpu")) as enter:
        ...         assert enter is not None
        ...         enter(4)
        ...         masks.append(torch.nn.functional.dropout(torch.ones(6), 0.5))
        >>> torch.equal(masks[0], masks[1])
        True
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        """Seed of the current step (or forward call)."""

    def touches_generators(self, stage: int) -> bool:
        """Whether :meth:`scope` seeds (and restores) torch's generators for ``stage``:
        it must then not run beside other code that draws from them."""
        return True

    @contextlib.contextmanager
    def scope(
        self, *, stage: int, microbatch: int, device: torch.device
    ) -> Iterator[LayerHook | None]:
        """Run one forward of ``stage`` on micro-batch ``microbatch``; yields the hook to
        call before each layer (``None``: run the stage as it is, unseeded)."""
        with seeded_layers(self.seed, microbatch, device) as enter:
            yield enter


@contextlib.contextmanager
def seeding_hooks(layers: Sequence[nn.Module], enter: LayerHook,
                   first_layer: int) -> Iterator[None]:
    """Forward pre-hooks that call ``enter(first_layer + l)`` before the ``l``-th layer
    call, while the block runs (a layer listed twice is entered at each position).

    Example:
        >>> layer = nn.Identity()
        >>> seen = []
        >>> with seeding_hooks([layer, layer], seen.append, 3):
        ...     _ = layer(torch.ones(1)), layer(torch.ones(1))
        >>> seen
        [3, 4]
    """
    positions = itertools.count(first_layer)

    def seed(*_: Any) -> None:
        enter(next(positions))

    handles = [layer.register_forward_pre_hook(seed, prepend=True)
               for layer in dict.fromkeys(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
