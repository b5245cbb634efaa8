"""torchgpipe-compatible automatic balancing: ``from pipetrain.balance import ...``.

An alias of :mod:`pipetrain.partition.balance`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    >>> sum(balance_by_time(2, model, torch.randn(2, 4), timeout=0.0, device="cpu"))
    3
"""

from pipetrain.partition.balance import balance_by_size, balance_by_time

__all__ = ["balance_by_size", "balance_by_time"]
