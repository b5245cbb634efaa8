"""torchgpipe's per-layer profiles for balancing, under torchgpipe's names: the profiler's.

``profile_times`` and ``profile_sizes`` are :mod:`pipetrain.plan.layer_costs`'s, and
``default_device`` is :mod:`pipetrain.plan.profiler_inputs`'s: pipetrain measures layers
in one place, the profiler of :mod:`pipetrain.plan` (this module only names them where
torchgpipe users look for them).

Example:
    >>> import torch
    >>> from torch import nn
    >>> # a 16-byte output row in a 512-byte block, x 2 rows; 2 x 80 parameter bytes
    >>> profile_sizes(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), chunks=1,
    ...               param_scale=2.0, device=torch.device("cpu"))
    [1184]
"""

from pipetrain.plan.layer_costs import profile_sizes, profile_times
from pipetrain.plan.memory import cuda_block_bytes
from pipetrain.plan.profiler_inputs import default_device

__all__ = ["cuda_block_bytes", "default_device", "profile_sizes", "profile_times"]
