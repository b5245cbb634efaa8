"""Random streams for stages that share a process: deterministic per (stage, micro-batch).

torch has one CPU generator per process (and one per GPU). Stages that run in threads of
one process would draw from it in an order that depends on thread timing, and the
recomputation of a checkpointed micro-batch would not see the state its forward saw.
Stages that draw random numbers therefore run their forward (and recomputation) under a
lock, with the generator seeded from ``(step seed, stage, micro-batch)``: the masks do
not depend on timing, and the recomputation repeats them exactly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["SeededRng", "is_stochastic", "mix_seed"]

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
    """Whether ``module`` may draw random numbers in training.

    True for dropout layers with ``p > 0``, ``RReLU``, modules with a positive numeric
    ``dropout`` attribute (attention layers), and modules that set
    ``pipetrain_stochastic = True`` (the way to declare a custom random layer).

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


class SeededRng:
    """Per-(stage, micro-batch) random streams behind one lock.

    Set :attr:`step_seed` once per step (drawn from the caller's generator, so the run
    stays reproducible under ``torch.manual_seed``); wrap every forward of a random stage
    in :meth:`scope`.

    Example:
        >>> rng = SeededRng()
        >>> rng.step_seed = 7
        >>> with rng.scope(stage=1, microbatch=2, device=torch.device("cpu")):
        ...     a = torch.rand(2)
        >>> with rng.scope(stage=1, microbatch=2, device=torch.device("cpu")):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.step_seed = 0

    def new_step(self) -> None:
        """Draw the next step seed from the global generator (call from the main thread)."""
        self.step_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())

    def touches_generators(self, stage: int) -> bool:
        """Whether :meth:`scope` seeds (and restores) torch's generators for ``stage``:
        it must then not run beside other code that draws from them."""
        return True

    @contextlib.contextmanager
    def scope(self, *, stage: int, microbatch: int, device: torch.device) -> Iterator[None]:
        """Run the block alone, with the generators seeded for this stage and micro-batch."""
        seed = mix_seed(self.step_seed, stage, microbatch)
        cuda = [device.index or 0] if device.type == "cuda" else []
        with self.lock, torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
            yield
