"""Mixed precision: autocast in every stage, and the dynamic loss scale of fp16 training.

``mixed_precision="bf16"`` or ``"fp16"`` runs every stage's forward, and the
recomputation of its checkpointed micro-batches, under ``torch.autocast`` of the stage's
device type with that dtype (the loss too, as torch's AMP recipe does). Parameters,
gradients and optimizer state stay float32: autocast casts a weight to the low dtype
inside each op and autograd casts its gradient back, so the optimizer updates float32
*master weights* with no copy of its own.

fp16 gradients underflow, so fp16 training scales the loss by ``S`` before backward and
divides the gradients by ``S`` before the optimizer step. :class:`LossScaler` holds ``S``
and changes it as ``torch.amp.GradScaler`` does: a step whose gradients are not finite
is skipped and ``S`` is multiplied by ``backoff_factor``; after ``growth_interval``
finite steps in a row ``S`` is multiplied by ``growth_factor``. Whether a step is
finite is decided once for the whole job by the pipeline's global gradient check (one
all-reduce over every stage and replica), so every rank skips the same steps and holds
the same ``S``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["MIXED_PRECISIONS", "LossScaler", "LossScaling", "autocast_dtype", "precision_problem",
           "stage_autocast"]

MIXED_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The accepted ``mixed_precision`` values and their autocast dtypes (``None``: float32)."""


def precision_problem(value: object, *, spelled: str) -> str | None:
    """What is wrong with a ``mixed_precision`` value (``None``: nothing), with the fix.

    Example:
        >>> precision_problem("fp8", spelled="mixed_precision='fp8'")
        "mixed_precision='fp8' is not a mixed precision; choose 'bf16', 'fp16' or None (float32)"
        >>> precision_problem("bf16", spelled="") is None
        True
    """
    if value is None or (isinstance(value, str) and value in MIXED_PRECISIONS):
        return None
    return f"{spelled} is not a mixed precision; choose 'bf16', 'fp16' or None (float32)"


def autocast_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The autocast dtype of a ``mixed_precision`` value (``None``: no autocast).

    Raises:
        ValueError: an unknown value; the message lists the accepted ones.

    Example:
        >>> autocast_dtype("bf16"), autocast_dtype(None)
        (torch.bfloat16, None)
    """
    problem = precision_problem(mixed_precision, spelled=f"mixed_precision={mixed_precision!r}")
    if problem is not None:
        raise ValueError(problem)
    return None if mixed_precision is None else MIXED_PRECISIONS[mixed_precision]


@contextlib.contextmanager
def stage_autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to ``dtype`` on ``device``'s type (nothing when ``dtype`` is ``None``).

    Example:
        >>> with stage_autocast(torch.device("cpu"), torch.bfloat16):
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.bfloat16
    """
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """The settings of fp16's dynamic loss scale (``torch.amp.GradScaler``'s defaults)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def problems(self) -> list[str]:
        """Every problem with the settings, each with its fix."""
        found = []
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            found.append(f"LossScaling(init_scale={self.init_scale!r}) must be a positive number, "
                         "e.g. init_scale=65536.0")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            found.append(f"LossScaling(growth_factor={self.growth_factor!r}) must be above 1, "
                         "e.g. growth_factor=2.0")
        if not 0 < self.backoff_factor < 1:
            found.append(f"LossScaling(backoff_factor={self.backoff_factor!r}) must be between 0 and "
                         "1, e.g. backoff_factor=0.5")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            found.append(f"LossScaling(growth_interval={self.growth_interval!r}) must be a positive "
                         "integer, e.g. growth_interval=2000")
        return found


class LossScaler:
    """The dynamic loss scale ``S`` of fp16 training (the same on every rank).

    Example:
        >>> scaler = LossScaler(LossScaling(init_scale=8.0, growth_interval=2))
        >>> scaler.update(finite=False); scaler.scale
        4.0
        >>> scaler.update(finite=True); scaler.update(finite=True); scaler.scale
        8.0
    """

    def __init__(self, settings: LossScaling | None = None) -> None:
        self.settings = LossScaling() if settings is None else settings
        problems = self.settings.problems()
        if problems:
            raise ValueError("invalid LossScaling:\n" + "\n".join(f"  * {p}" for p in problems))
        self.scale = float(self.settings.init_scale)
        """The current scale ``S``: losses are multiplied by it before backward."""
        self.growth_tracker = 0
        """Finite steps in a row since the scale last changed."""

    def update(self, *, finite: bool) -> None:
        """Back off after a non-finite step; grow after ``growth_interval`` finite ones."""
        if not finite:
            self.scale *= self.settings.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.settings.growth_interval:
            self.scale *= self.settings.growth_factor
            self.growth_tracker = 0

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide ``grads`` by the scale, in place."""
        inverse = 1.0 / self.scale
        for grad in grads:
            grad.mul_(inverse)

    def state_dict(self) -> dict[str, float]:
        """The scale and its growth tracker (saved with checkpoints)."""
        return {"scale": self.scale, "growth_tracker": float(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
