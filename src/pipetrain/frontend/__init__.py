"""The frontend: any ``nn.Module`` (Hugging Face models unmodified) as a pipeline's stages.

A model is captured once with torch.export (non-strict) into a graph of ATen operations,
cut into units at module boundaries (every candidate module and every split point), and
each unit becomes a module ``forward(message) -> message`` that the runtime runs like
any layer. See ``docs/frontend.md``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> captured = CapturedModel.create(model, (torch.randn(3, 4),), split_points=["2"],
    ...                                 num_stages=2)
    >>> captured.split_balance
    [2, 1]
"""

from pipetrain.frontend.errors import CaptureError
from pipetrain.frontend.materialize import SafetensorsWeights
from pipetrain.frontend.source import CapturedModel, Tie

__all__ = ["CaptureError", "CapturedModel", "SafetensorsWeights", "Tie"]
