"""Random streams of a single-process pipeline: seeded per forward call, layer and
micro-batch, with the random stages found out by watching the generators.

The stages of a :class:`~pipetrain.api.gpipe.GPipe` are threads sharing torch's
generators. A stage that draws random numbers (dropout) must draw the same numbers when
a checkpointed micro-batch is recomputed, and should not depend on thread timing. It
therefore runs under a lock, its layers seeded one by one from ``(call seed, global
layer index, micro-batch)`` -- the mechanism of the multi-process
:class:`~pipetrain.api.pipeline.Pipeline` (:mod:`pipetrain.runtime.rng`), so the masks
do not depend on the balance either. Each forward call takes its seed from the caller's
generator, so ``torch.manual_seed`` before a run reproduces it, and a recomputation that
runs after later forwards (several forwards before one ``backward()``) still sees its
own call's seed. A call that draws random numbers moves the caller's generator on (by
one draw); one that draws none leaves it as it was, as a deterministic
``nn.Sequential`` does.

Which stages draw is not left to a list of layer types: a custom layer calling
``F.dropout`` or ``torch.rand`` would be missed and recomputed with other masks (wrong
gradients). A stage known to be random (:func:`is_stochastic`) is always seeded; any
other is seeded and watched, layer by layer, during its first training-mode forward
calls, and once it was seen drawing nothing it runs freely (no lock, no seeding), so
deterministic stages still run concurrently.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pipetrain.runtime.rng import LayerHook, RandomStreams, generators, seeded_layers

__all__ = ["KEY_STRIDE", "SessionRng", "is_stochastic"]

KEY_STRIDE = 1 << 20
"""Micro-batch keys of forward call ``n`` are ``n * KEY_STRIDE + i``."""


def _draw_seed() -> int:
    """A number drawn from the caller's CPU generator (moving it on)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def _peek_seed() -> int:
    """A seed read from the caller's CPU generator's state (leaving it as it is)."""
    state = torch.default_generator.get_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 2


_STOCHASTIC = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


def is_stochastic(module: nn.Module) -> bool:
    """Whether ``module`` is known to draw random numbers in training (a hint that spares
    a stage the watching; stages are watched whatever it says).

    True for dropout layers with ``p > 0``, ``RReLU``, modules with a positive numeric
    ``dropout`` attribute (attention layers), and modules that set
    ``pipetrain_stochastic = True``.

    Example:
        >>> is_stochastic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
        True
        >>> is_stochastic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
        False
    """
    for sub in module.modules():
        if getattr(sub, "pipetrain_stochastic", False):
            return True
        if isinstance(sub, nn.RReLU):
            return True
        if isinstance(sub, _STOCHASTIC) and getattr(sub, "p", 0) > 0:
            return True
        rate = getattr(sub, "dropout", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            return True
    return False


class _Watch:
    """A layer hook that also notes whether any layer drew from the generators."""

    def __init__(self, enter: LayerHook, device: torch.device) -> None:
        self.enter = enter
        self.generators = generators(device)
        self.seeded: list[torch.Tensor] | None = None
        self.drew = False

    def _check(self) -> None:
        if self.seeded is not None and not self.drew:
            now = [g.get_state() for g in self.generators]
            self.drew = any(not torch.equal(a, b) for a, b in zip(self.seeded, now))

    def __call__(self, layer: int) -> None:
        self._check()  # did the previous layer draw?
        self.enter(layer)
        self.seeded = [g.get_state() for g in self.generators]

    def done(self) -> bool:
        """Whether some layer drew (call after the last layer ran)."""
        self._check()
        return self.drew


class SessionRng(RandomStreams):
    """Per-(forward call, layer, micro-batch) random streams for the stages ``modules``.

    :meth:`open` takes the seed of a forward call (keys ``offset + i``) before it runs,
    :meth:`forward_done` is told when its forward phase ran, :meth:`close` forgets it.
    A stage not known to be random is watched during its first ``watch`` training-mode
    forward calls.

    Example:
        >>> layers = [nn.Linear(2, 2), nn.Dropout(0.5)]
        >>> rng = SessionRng(layers)
        >>> rng.open(0)
        >>> with rng.scope(stage=1, microbatch=3, device=torch.device("cpu")) as enter:
        ...     enter(1)
        ...     a = torch.rand(2)
        >>> rng.open(KEY_STRIDE)  # a later forward call, with its own seed
        >>> with rng.scope(stage=1, microbatch=3, device=torch.device("cpu")) as enter:
        ...     enter(1)
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)  # micro-batch 3 of forward call 0 again
        True
        >>> for call in range(2):  # stage 0 draws nothing in two training calls
        ...     rng.open(call * KEY_STRIDE)
        ...     with rng.scope(stage=0, microbatch=call * KEY_STRIDE,
        ...                    device=torch.device("cpu")) as enter:
        ...         enter(0)
        ...         _ = layers[0](torch.ones(2))
        >>> rng.quiet
        {0}
    """

    def __init__(self, modules: Sequence[nn.Module], *, watch: int = 2) -> None:
        super().__init__()
        self.lock = threading.Lock()
        """held while a seeded stage runs: stages share torch's generators"""
        self.modules = list(modules)
        self.watch = watch
        self.random = {j for j, module in enumerate(self.modules) if is_stochastic(module)}
        """stages that draw random numbers: always seeded"""
        self.quiet: set[int] = set()
        """stages seen drawing nothing during ``watch`` training calls: run freely"""
        self._watched: dict[int, set[int]] = {}
        self._seeds: dict[int, int] = {}

    @property
    def needed(self) -> bool:
        """Whether some stage may still draw (else forward calls need no seed)."""
        return len(self.quiet) < len(self.modules)

    def open(self, key_offset: int) -> None:
        """Take the seed of the forward call whose keys start at ``key_offset`` from the
        caller's generator's state, without moving it on (main thread)."""
        for j in [j for j in self.quiet if is_stochastic(self.modules[j])]:
            self.quiet.discard(j)  # e.g. a dropout rate raised from 0 since
            self.random.add(j)
        if self.needed:
            self._seeds[key_offset] = _peek_seed()

    def forward_done(self, key_offset: int) -> None:
        """The forward phase of the call ran: if a stage draws random numbers, move the
        caller's generator on (by one draw), as those draws would have (main thread)."""
        if self.random and key_offset in self._seeds:
            _draw_seed()

    def close(self, key_offset: int) -> None:
        """Forget the seed of a finished forward call."""
        self._seeds.pop(key_offset, None)

    def touches_generators(self, stage: int) -> bool:
        return stage not in self.quiet

    @contextlib.contextmanager
    def scope(
        self, *, stage: int, microbatch: int, device: torch.device
    ) -> Iterator[LayerHook | None]:
        """Run a forward (or recomputation) of ``stage`` on micro-batch key ``microbatch``."""
        if stage in self.quiet:
            yield None
            return
        i = microbatch % KEY_STRIDE
        offset = microbatch - i
        with self.lock, seeded_layers(self._seeds[offset], i, device) as enter:
            if stage in self.random:
                yield enter
                return
            watch = _Watch(enter, device)
            yield watch
            if watch.done():
                self.random.add(stage)
            elif self.modules[stage].training:
                calls = self._watched.setdefault(stage, set())
                calls.add(offset)
                if len(calls) >= self.watch:
                    self.quiet.add(stage)
