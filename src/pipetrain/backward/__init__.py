"""The backward pass as pipeline stages run it: split into its input-gradient and
weight-gradient halves (zero-bubble schedules), weight gradients of linear layers
accumulated in place, and gradient buffers kept across steps.

Below the runtime (which runs stages with it) and the planner's profiler (which measures
it), above torch only.
"""

from pipetrain.backward.fused import fused_backward
from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.backward.split import WeightGradient, backward_input

__all__ = ["GradientPool", "WeightGradient", "backward_input", "fused_backward"]
