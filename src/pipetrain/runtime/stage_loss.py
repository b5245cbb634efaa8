"""The loss of a pipeline's last stage: ``loss_fn`` checked, its failures told as the stage's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipetrain.nested import describe_value

__all__ = ["LOSS_NOTE", "LossFn", "stage_loss"]

LOSS_NOTE = "pipetrain: raised by loss_fn"
"""How the note on an error of ``loss_fn`` starts."""

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> scalar``: the mean loss of one micro-batch."""


def stage_loss(loss_fn: LossFn, output: Any, target: Any, *, stage_index: int,
               scale: float | None = None) -> torch.Tensor:
    """``loss_fn(output, target)`` (times ``scale`` if given); an error of ``loss_fn`` gets a
    note naming the last stage and what it got, a result that is not a scalar tensor a
    ``TypeError`` with the fix.

    Example:
        >>> stage_loss(torch.nn.functional.mse_loss, torch.ones(2), torch.zeros(2),
        ...            stage_index=1, scale=0.5)
        tensor(0.5000)
        >>> stage_loss(lambda out, y: out, torch.ones(2), None, stage_index=1)
        Traceback (most recent call last):
        ...
        TypeError: loss_fn returned (2,) float32, not a scalar tensor (pipetrain: raised by loss_fn on the output of the last stage (1): (2,) float32, with target NoneType); fix: loss_fn must return the mean loss of the micro-batch, e.g. torch.nn.functional.cross_entropy(...)
    """
    where = (f"{LOSS_NOTE} on the output of the last stage ({stage_index}): "
             f"{describe_value(output)}, with target {describe_value(target)}")
    try:
        loss = loss_fn(output, target)
    except Exception as error:
        error.add_note(f"{where}; the model's last layer must return what loss_fn(output, "
                       "target) takes (e.g. a tensor of logits), or loss_fn must unpack it")
        raise
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = describe_value(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(
            f"loss_fn returned {got}, not a scalar tensor ({where}); fix: loss_fn must return "
            "the mean loss of the micro-batch, e.g. torch.nn.functional.cross_entropy(...)"
        )
    return loss if scale is None else loss * scale
