"""Partitioning: cutting a layer sequence into stages, and balancing the cut.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    >>> [len(p) for p in split_module(model, solve([1, 1, 1, 1], 2))]
    [2, 2]
"""

from pipetrain.partition.balance import balance_by_size, balance_by_time
from pipetrain.partition.profile import default_device, profile_sizes, profile_times
from pipetrain.partition.solve import solve
from pipetrain.partition.split import BalanceError, split_module, verify_balance, verify_module

__all__ = [
    "BalanceError",
    "balance_by_size",
    "balance_by_time",
    "default_device",
    "profile_sizes",
    "profile_times",
    "solve",
    "split_module",
    "verify_balance",
    "verify_module",
]
