"""Skip connections: layers that hand tensors to later layers, across pipeline stages.

torchgpipe-compatible (``from pipetrain.skip import skippable, stash, pop, Namespace,
verify_skippables``), plus the runtime-facing pieces: :class:`SkipTracker`,
:func:`use_skip_tracker`, :func:`run_with_skips` and :func:`skip_layout`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> @skippable(stash=["skip"])
    ... class Save(nn.Module):
    ...     def forward(self, x):
    ...         yield stash("skip", x)
    ...         return x * 10
    >>> @skippable(pop=["skip"])
    ... class Add(nn.Module):
    ...     def forward(self, x):
    ...         return x + (yield pop("skip"))
    >>> model = nn.Sequential(Save(), nn.Identity(), Add())
    >>> verify_skippables(model)
    >>> model(torch.ones(1)).tolist()
    [11.0]
"""

from pipetrain.skip.layout import SkipLayout, SkipRoute, skip_layout, verify_skippables
from pipetrain.skip.namespace import Namespace, SkipKey
from pipetrain.skip.skippable import Skippable, pop, skippable, stash
from pipetrain.skip.tracker import (
    SkipTracker,
    current_skip_tracker,
    run_with_skips,
    use_skip_tracker,
)

__all__ = [
    "Namespace",
    "SkipKey",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "current_skip_tracker",
    "pop",
    "run_with_skips",
    "skip_layout",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
